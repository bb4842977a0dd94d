"""`moeflow train`: the model, the data, a short run whose loss falls, exact resume, checkpoint
resharding between 1 and 2 workers, the data-parallel gradient, a killed worker, bad input, the
report and sampling. Tiny models on a small real corpus (the standard library's ``json`` package)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moeflow.data import corpus_files, is_validation_document, prepare_corpus, stdlib_directory
from moeflow.distributed import WorkerError
from moeflow.models import MoETransformer, TransformerConfig
from moeflow.timing.phases import PhaseClock
from moeflow.training import TrainConfig
from moeflow.training.checkpoint import latest_checkpoint, load_checkpoint, read_state
from moeflow.training.evaluation import evaluate
from moeflow.training.gradients import synchronize_gradients
from moeflow.training.launch import run_training
from moeflow.training.metrics import iterate_records
from moeflow.training.sharded_checkpoint import saved_tensors
from moeflow.training.trainer import rank_planner_states
from pool import run_distributed

DATA = str(stdlib_directory() / "json")
TINY: dict[str, Any] = dict(
    data=DATA, vocab_size=512, context=32, layers=2, heads=2, model_dim=32, hidden_dim=64, num_experts=4,
    top_k=2, batch_size=4, steps=12, eval_interval=6, eval_windows=8, checkpoint_interval=6, warmup_steps=2,
    lr=1e-2, min_lr=1e-3, pipeline=1, alltoall="linear", progress=False,
    expert_kernel="bmm",  # two runs compared bit for bit: expert_kernel='auto' probes each run's own rates
)


def tiny(run_dir: Path, **changes: Any) -> TrainConfig:
    return TrainConfig(**{**TINY, "run_dir": str(run_dir), **changes})


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in iterate_records(run_dir)}


@pytest.fixture(scope="session")
def two_worker_run(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> Path:
    """12 steps on 2 workers, checkpoints at 6 and 12, report written."""
    run_dir = tmp_path_factory.mktemp("runs") / "uninterrupted"
    run_training(tiny(run_dir))
    return run_dir


# -- model and data ------------------------------------------------------------------------------


def test_model_counts_active_parameters_and_rejects_bad_shapes() -> None:
    config = TransformerConfig.build(vocab_size=100, context=16, layers=2, heads=2, model_dim=16, hidden_dim=32,
                               num_experts=4, top_k=1, moe_every=2, pipeline=1)
    model = MoETransformer(config)
    total = sum(p.numel() for p in model.parameters()) - model.position_embedding.weight.numel()
    inactive = 3 * (2 * 16 * 32 + 32 + 16)  # three of the four experts of block 1 are not used by a token
    assert config.active_parameters() == total - inactive
    assert config.moe_blocks == [1] and model.blocks[0].moe is None and model.blocks[1].moe is not None
    with pytest.raises(ValueError, match="model_dim=30 is not divisible by heads=4"):
        TransformerConfig.build(vocab_size=10, model_dim=30, heads=4)
    with pytest.raises(ValueError, match="top_k"):
        TransformerConfig.build(vocab_size=10, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_stdlib_corpus_skips_tests_and_split_is_deterministic(tmp_path: Path) -> None:
    root, files = corpus_files(None)
    names = [str(f.relative_to(root)) for f in files]
    assert len(files) > 300 and "json/decoder.py" in names
    assert not any(part in ("test", "site-packages") for name in names for part in Path(name).parts)
    val = [n for n in names if is_validation_document(n, 5.0)]
    assert 0.02 < len(val) / len(names) < 0.09 and val == [n for n in names if is_validation_document(n, 5.0)]
    with pytest.raises(FileNotFoundError, match=r"data path .* does not exist"):
        corpus_files(str(tmp_path / "missing"))


def test_corpus_tokenizers_round_trip_and_unigram_baseline(tmp_path: Path) -> None:
    text = "def add(a, b):\n    return a + b  # é\n" * 200
    (tmp_path / "a.py").write_text(text)
    for kind, vocab in (("bytes", range(257, 258)), ("bpe", range(258, 301))):  # BPE stops when no pair repeats
        corpus = prepare_corpus(str(tmp_path / "a.py"), kind, 300, cache_dir=str(tmp_path / kind))
        assert corpus.vocab_size in vocab and corpus.train_tokens > corpus.val_tokens > 0
        from moeflow.data import load_tokenizer

        tokenizer = load_tokenizer(corpus.tokenizer_path)
        assert tokenizer.decode(tokenizer.encode(text[:200]).ids) == text[:200]
        assert 0 < corpus.unigram_entropy < corpus.unigram_val_loss + 0.5
        assert prepare_corpus(str(tmp_path / "a.py"), kind, 300, cache_dir=str(tmp_path / kind)) == corpus  # cached


def test_phase_clock_times_forward_and_backward_of_a_phase() -> None:
    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(0.2)
            return grad * 2

    clock = PhaseClock()
    x = torch.ones(3, requires_grad=True)
    y = clock.around("slow", x, Slow.apply) + clock.around("fast", x, lambda h: h + 1)
    # bounds well apart from each sleep, so a loaded machine cannot flip them but a misattribution would
    assert 0.05 <= clock.seconds["slow"] < 0.2 and clock.seconds["fast"] < 0.05
    y.sum().backward()
    assert clock.seconds["slow"] >= 0.25 and clock.seconds["fast"] < 0.05
    assert torch.equal(x.grad, torch.full((3,), 3.0))


# -- data-parallel + expert-parallel gradient ----------------------------------------------------


def _synced_gradients(rank: int, world_size: int, config: TransformerConfig) -> dict[str, Any]:
    import torch.distributed as dist

    model = MoETransformer(config, group=dist.group.WORLD, seed=3)
    batch = torch.randint(0, config.vocab_size, (4, config.context + 1), generator=torch.Generator().manual_seed(9))
    mine = batch.chunk(world_size)[rank]
    _, loss = model(mine[:, :-1], mine[:, 1:])
    loss.backward()
    experts = model.expert_parameter_names()
    synchronize_gradients(model, experts, dist.group.WORLD, world_size)
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        if name in experts:
            parts = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(parts, grad)
            grad = torch.cat(parts)
        grads[name] = grad.numpy()  # tensors would travel as shared memory that dies with the worker
    return grads


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [pytest.param("expert", marks=pytest.mark.smoke), "replicated", 0, "adaptive"])
def test_two_workers_give_the_gradient_of_one_worker_on_the_whole_batch(parallel: str | int) -> None:
    # no token dropped and no balance loss: the global mean loss is then exactly the one-worker loss;
    # replicated experts are summed by the trainer's all-reduce, expert-parallel ones by the all-to-all
    config = TransformerConfig.build(vocab_size=64, context=8, layers=2, heads=2, model_dim=16, hidden_dim=32,
                               num_experts=4, capacity_factor=0.0, aux_loss_weight=0.0, pipeline=1, alltoall="linear",
                               parallel=parallel)
    one = run_distributed(_synced_gradients, 1, config)[0]
    two = run_distributed(_synced_gradients, 2, config)
    assert set(one) == set(two[0]) and any("experts" in name for name in one)
    for name, grad in one.items():
        for rank in (0, 1):
            torch.testing.assert_close(torch.from_numpy(two[rank][name]), torch.from_numpy(grad), rtol=1e-5,
                                       atol=1e-7, msg=name)


# -- training runs -------------------------------------------------------------------------------


@pytest.mark.distributed
def test_short_run_loss_falls_and_writes_metrics_plots_checkpoints(two_worker_run: Path) -> None:
    records = list(iterate_records(two_worker_run))
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[0], records[-1]
    assert last["loss"] < first["loss"] - 0.5
    assert "val_loss" in records[5] and "val_loss" in last and "val_loss" not in records[6]
    assert set(last["time_s"]) >= {"attention", "routing", "all_to_all", "experts", "grad_sync", "optimizer"}
    assert all(v >= 0 for v in last["time_s"].values()) and last["time_s"]["experts"] > 0
    for layer in last["moe"]:
        assert sum(layer["tokens_per_expert"]) == 2 * 4 * 32 * 2  # workers x batch x context x k
        assert layer["pipeline_degree"] == 1 and layer["alltoall"] == "linear"
    assert json.loads((two_worker_run / "config.json").read_text())["workers"] == 2
    for plot in ("loss.png", "expert_load.png", "time_breakdown.png"):
        assert (two_worker_run / plot).stat().st_size > 10_000
    assert sorted(p.name for p in (two_worker_run / "checkpoints").glob("step-*")) == ["step-000006", "step-000012"]
    assert latest_checkpoint(two_worker_run) == two_worker_run / "checkpoints" / "step-000012"
    summary = json.loads((two_worker_run / "summary.json").read_text())
    assert summary["val_loss"] == last["val_loss"] and summary["unigram_entropy"] > 0


@pytest.mark.distributed
def test_resume_repeats_the_losses_of_an_uninterrupted_run(
    two_worker_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_training(tiny(tmp_path / "resumed", stop_at=5, checkpoint_interval=100), report=False)
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000005"
    from moeflow.cli import main

    assert main(["train", "--resume", str(tmp_path / "resumed")]) == 0
    uninterrupted, resumed = losses(two_worker_run), losses(tmp_path / "resumed")
    assert list(resumed) == list(range(1, 13))  # no step twice in metrics.jsonl
    assert resumed == uninterrupted  # bit for bit
    state = json.loads((latest_checkpoint(tmp_path / "resumed") / "state.json").read_text())
    saved = {"dictionary", "settled_at", "trial_cost", "searches", "kernel_rates"}  # the planners' state travels
    assert len(state["planners_by_rank"]) == 2  # every rank's own
    for planners in state["planners_by_rank"]:
        assert len(planners) == TINY["layers"] // TINY.get("moe_every", 1)
        assert all(set(p) == saved for p in planners)

    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "resumed")]) == 0  # complete: says so, trains nothing
    out, err = capsys.readouterr()
    assert "is complete (step 12 of 12): nothing to train" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["complete"] and summary["step"] == 12 and "NaN" not in out
    assert losses(tmp_path / "resumed") == resumed


@pytest.mark.distributed
def test_a_nonfinite_loss_on_one_worker_skips_the_step_on_every_worker(tmp_path: Path) -> None:
    from moeflow.training.faults import FaultPlan

    summary = run_training(tiny(tmp_path / "nan", steps=6, eval_interval=100, checkpoint_interval=6),
                           report=False, faults=FaultPlan(nonfinite_loss=((1, 3), (0, 5))))
    records = {r["step"]: r for r in iterate_records(tmp_path / "nan")}
    assert [step for step, r in records.items() if r["skipped"]] == [3, 5] and summary["skipped_steps"] == 2
    assert math.isfinite(records[6]["loss"]) and math.isfinite(summary["loss"])
    reference = run_training(tiny(tmp_path / "clean", steps=2, eval_interval=100, checkpoint_interval=6),
                             report=False)
    assert [r["loss"] for r in iterate_records(tmp_path / "clean")] == [records[1]["loss"], records[2]["loss"]]
    assert reference["skipped_steps"] == 0
    with pytest.raises(WorkerError, match=r"not finite on some worker for 2 steps in a row \(steps 2 to 3"):
        run_training(tiny(tmp_path / "diverged", steps=6, eval_interval=100, max_nonfinite_steps=2),
                     report=False, faults=FaultPlan(nonfinite_loss=((0, 2), (1, 3))))


def test_json_lines_never_hold_nan() -> None:
    from moeflow.files import json_text

    text = json_text({"loss": float("nan"), "norms": [1.0, float("inf")], "nested": {"x": -float("inf")}})
    assert json.loads(text) == {"loss": None, "norms": [1.0, None], "nested": {"x": None}}
    from moeflow.training.report import _smooth

    smoothed = _smooth(np.array([float("nan"), 1.0, float("nan"), 2.0]))  # a skipped step is a gap
    assert np.isnan(smoothed[0]) and list(smoothed[1:3]) == [1.0, 1.0]
    assert smoothed[3] == pytest.approx((0.9 * 0.1 + 0.1 * 2.0) / (1 - 0.9**2))  # bias corrected


def _plan_choices(run_dir: Path) -> dict[int, list[tuple[int, str]]]:
    return {r["step"]: [(m["pipeline_degree"], m["plan_source"]) for m in r["moe"]] for r in iterate_records(run_dir)}


def test_a_resumed_rank_takes_back_its_own_planners() -> None:
    own = [[{"searches": {"3": {"rank": rank}}}] for rank in range(3)]
    state = {"planners_by_rank": own}
    assert [rank_planner_states(state, rank, 3) for rank in range(3)] == own
    assert rank_planner_states(state, 1, 2) == own[0]  # another world size: rank 0's, as before
    assert rank_planner_states({"planners": own[2]}, 1, 3) == own[2]  # a checkpoint from before
    assert rank_planner_states({}, 0, 1) == []


@pytest.mark.distributed
def test_resume_under_auto_continues_the_planners_search_bit_for_bit(tmp_path: Path) -> None:
    """pipeline=auto's first round of trials walks d = 1, 2, 4 (the pipelined degrees change the
    float sums, so the losses depend on the choices; the later rounds follow measured times, which
    no two runs share). Interrupted at step 2, after d = 1's trial, the resumed run continues the
    saved round: d = 2 and d = 4 at steps 3 and 4 and the same losses bit for bit as the
    uninterrupted run (restarting the search would rerun the warm-up from step 3)."""
    # a fixed capacity keeps every step in one capacity bucket (dropless, a layer whose largest load
    # moves by over a quarter starts a new search: the walk below would differ by layer)
    steps = dict(pipeline="auto", steps=4, checkpoint_interval=100, capacity_factor=1.25)
    run_training(tiny(tmp_path / "whole", **steps), report=False)
    run_training(tiny(tmp_path / "resumed", stop_at=2, **steps), report=False)
    saved = read_state(latest_checkpoint(tmp_path / "resumed"))
    by_rank = saved["planners_by_rank"]  # each rank's own trial times, which it takes back
    assert "planners" not in saved and len(by_rank) == 2 and all(len(rank) == TINY["layers"] for rank in by_rank)
    assert all(layer["searches"] for rank in by_rank for layer in rank)  # interrupted mid-search
    run_training(tiny(tmp_path / "resumed", **steps), latest_checkpoint(tmp_path / "resumed"), report=False)
    whole, resumed = _plan_choices(tmp_path / "whole"), _plan_choices(tmp_path / "resumed")
    assert resumed == whole and {degree for layers in whole.values() for degree, _ in layers} == {1, 2, 4}
    assert whole[3] == [(2, "trial")] * TINY["layers"] and whole[4] == [(4, "trial")] * TINY["layers"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")


@pytest.mark.distributed
@pytest.mark.parametrize("grad_sync", ["overlap", "lina"])
def test_gradient_sync_during_the_backward_trains_and_resumes_like_after(
    two_worker_run: Path, tmp_path: Path, grad_sync: str
) -> None:
    # on 2 workers a sum of two gradients is the same in any order: the losses match bit for bit
    run_dir = tmp_path / grad_sync
    run_training(tiny(run_dir, grad_sync=grad_sync, microop_mb=0.002, bucket_mb=0.01, stop_at=5,
                      checkpoint_interval=100), report=False)
    from moeflow.cli import main

    assert main(["train", "--resume", str(run_dir)]) == 0
    assert losses(run_dir) == losses(two_worker_run)
    records = list(iterate_records(run_dir))
    assert all(r["comm_s"]["allreduce_ops"] > 0 for r in records)  # rank 0's timeline saw the micro-ops
    assert {"all_to_all_alone", "all_to_all_with_allreduce"} <= set(records[-1]["comm_s"])
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert timeline["step"] == 12 and {"forward", "backward", "alltoall", "allreduce"} <= {
        kind for kind, _, _ in timeline["events"]}
    assert (run_dir / "timeline.png").stat().st_size > 0


def _evaluate_checkpoint(rank: int, world_size: int, checkpoint: str, parallel: str | int | None = None) -> float:
    import torch.distributed as dist

    from moeflow.data import PreparedCorpus

    state = read_state(Path(checkpoint))
    parallel = "expert" if parallel is None else parallel
    plain = {"workers": world_size, "parallel": parallel, "mp_size": 1, "esp_size": None}
    config = TrainConfig(**state["config"]).updated(plain)
    corpus = PreparedCorpus(**state["corpus"])
    model = MoETransformer(config.model_config(corpus.vocab_size), group=dist.group.WORLD)
    load_checkpoint(Path(checkpoint), model, None, rank, world_size)
    return evaluate(model, corpus.load("val"), config, rank, world_size, dist.group.WORLD, torch.device("cpu"))


@pytest.mark.distributed
def test_checkpoints_reshard_between_one_and_two_workers(two_worker_run: Path, tmp_path: Path) -> None:
    from_two = str(latest_checkpoint(two_worker_run))
    on_one = run_distributed(_evaluate_checkpoint, 1, from_two)[0]
    on_two = run_distributed(_evaluate_checkpoint, 2, from_two)[0]
    recorded = list(iterate_records(two_worker_run))[-1]["val_loss"]
    assert on_two == pytest.approx(recorded, rel=1e-6) and on_one == pytest.approx(recorded, rel=1e-5)

    run_training(tiny(tmp_path / "one", workers=1, steps=4, checkpoint_interval=4), report=False)
    from_one = str(latest_checkpoint(tmp_path / "one"))
    assert run_distributed(_evaluate_checkpoint, 2, from_one)[0] == pytest.approx(
        run_distributed(_evaluate_checkpoint, 1, from_one)[0], rel=1e-5
    )
    # and training goes on with the other number of workers
    checkpoint = latest_checkpoint(tmp_path / "one")
    summary = run_training(tiny(tmp_path / "one", workers=2, steps=6), checkpoint, report=False)
    assert summary["workers"] == 2 and list(losses(tmp_path / "one")) == list(range(1, 7))


@pytest.mark.distributed
def test_a_four_worker_checkpoint_holds_each_ranks_experts_in_its_file_and_loads_on_one_two_and_four(
    tmp_path: Path,
) -> None:
    """Each rank writes only its own experts (and the optimizer's moments of them); the checkpoint
    evaluates alike on 1, 2 and 4 workers, expert parallel, replicated and packed."""
    import torch.distributed.checkpoint as dcp

    run_training(tiny(tmp_path / "four", workers=4, steps=4, checkpoint_interval=4), report=False)
    checkpoint = latest_checkpoint(tmp_path / "four")
    storage = dcp.FileSystemReader(str(checkpoint)).read_metadata().storage_data
    expert_files = {(index.fqn, index.offset[0]): info.relative_path for index, info in storage.items()
                    if ".experts." in index.fqn and not index.fqn.endswith(".step")}
    assert len(expert_files) == 3 * 4 * 2 * 4  # (weights, 2 moments) x (w1, b1, w2, b2) x 2 layers x 4 experts
    assert all(path == f"__{expert}_0.distcp" for (_, expert), path in expert_files.items())
    recorded = list(iterate_records(tmp_path / "four"))[-1]["val_loss"]
    on = {(workers, parallel): run_distributed(_evaluate_checkpoint, workers, str(checkpoint), parallel)[0]
          for workers, parallel in ((4, "expert"), (2, "expert"), (1, "expert"), (2, "replicated"))}
    assert on[(4, "expert")] == pytest.approx(recorded, rel=1e-6)
    assert all(loss == pytest.approx(recorded, rel=1e-5) for loss in on.values()), on


@pytest.mark.distributed
def test_experts_over_two_of_four_workers_train_the_four_worker_model_and_resume_on_any_layout(
    tmp_path: Path,
) -> None:
    """--ep-size 2 on 4 workers (two expert groups, copies of each other over a (dp, ep) mesh) trains
    what --workers 4 trains when dropless: the same losses and, at the end, the same model and AdamW
    state in the checkpoint; its checkpoint, written once per expert, resumes on 4 workers with the
    experts over all of them and on 2, step for step."""
    dropless = {"workers": 4, "steps": 4, "checkpoint_interval": 2, "capacity_factor": 0.0}
    run_training(tiny(tmp_path / "ep4", **dropless), report=False)
    assert run_training(tiny(tmp_path / "ep2", **dropless, ep_size=2), report=False)["ep_size"] == 2
    expected = losses(tmp_path / "ep4")
    assert list(expected) == [1, 2, 3, 4]
    for step, loss in losses(tmp_path / "ep2").items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    final = {name: latest_checkpoint(tmp_path / name) for name in ("ep4", "ep2")}
    keys = set(saved_tensors(final["ep4"]))
    assert set(saved_tensors(final["ep2"])) == keys and any(".experts." in key for key in keys)
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(final["ep2"])).read_metadata().storage_data
    writers = {info.relative_path for index, info in storage.items()
               if ".experts." in index.fqn and not index.fqn.endswith(".step")}
    assert writers == {"__0_0.distcp", "__1_0.distcp"}  # each expert written once, by the first expert group
    from moeflow.training.sharded_checkpoint import read_full_tensors

    got, want = (read_full_tensors(final[name], sorted(keys)) for name in ("ep2", "ep4"))
    for key in sorted(keys):
        # atol: the attention's key bias has a gradient of rounding noise only (softmax ignores it), which
        # AdamW scales to steps of lr's size: the summation order moves it by up to 4e-6 in 4 steps
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=key)
    from safetensors.torch import load_file

    from moeflow.cli import main

    exported = {}  # moeflow export reads the --ep-size run as any other
    for name in ("ep2", "ep4"):
        assert main(["export", str(tmp_path / name), "--out", str(tmp_path / f"{name}-export")]) == 0
        exported[name] = {key: tensor for path in (tmp_path / f"{name}-export").glob("*.safetensors")
                          for key, tensor in load_file(path).items()}
    assert exported["ep2"].keys() == exported["ep4"].keys() and any(".experts." in k for k in exported["ep2"])
    for key, tensor in exported["ep2"].items():
        torch.testing.assert_close(tensor, exported["ep4"][key], rtol=1e-5, atol=1e-5, msg=key)
    import shutil

    # the expert groups on two nodes each (one worker per node): the pairwise exchange takes the same steps
    pairwise = tmp_path / "ep2-pairwise"
    run_training(tiny(pairwise, **dropless, ep_size=2, ranks_per_node=1, alltoall="pairwise"), report=False)
    assert losses(pairwise) == pytest.approx(expected, rel=1e-5)
    assert {layer["alltoall"] for record in iterate_records(pairwise) for layer in record["moe"]} == {"pairwise"}
    for workers in (4, 2):  # a resume continues in the run's folder: each from its own copy
        resumed = shutil.copytree(tmp_path / "ep2", tmp_path / f"resumed-{workers}")
        run_training(tiny(resumed, **{**dropless, "workers": workers}), resumed / "checkpoints" / "step-000002",
                     report=False)
        again = losses(resumed)
        assert list(again) == [1, 2, 3, 4] and all(math.isfinite(loss) for loss in again.values())
        if workers == 4:  # the same data shards: the same steps
            assert again == pytest.approx(expected, rel=1e-5)


@pytest.mark.distributed
def test_balancing_and_packing_on_expert_groups_of_two_train_the_four_worker_model(tmp_path: Path) -> None:
    """--ep-size 2 of 4 workers with FasterMoE's shadowing, EPLB's slots (moved every step, also
    under --balance auto) and Lina's fixed packing: the same losses as plain expert parallelism over
    the 4 workers (dropless: each technique is exact). Each expert group's copy places its slots for
    the load summed over the copies, so the copies' experts keep lining up."""
    from equivalence import PROFILE_CHEAP_SHADOWS

    profile = tmp_path / "profile.json"
    PROFILE_CHEAP_SHADOWS.save(profile)
    dropless = {"workers": 4, "parallel": "expert", "steps": 4, "checkpoint_interval": 100, "eval_interval": 100,
                "capacity_factor": 0.0}
    run_training(tiny(tmp_path / "ep4", **dropless), report=False)
    expected = losses(tmp_path / "ep4")
    techniques = {
        "shadowing": {"shadowing": "auto", "profile": str(profile)},
        "slots": {"redundant_experts": 2, "rebalance_interval": 1},
        "balance": {"redundant_experts": 2, "rebalance_interval": 1, "balance": "auto", "profile": str(profile)},
        "packing": {"expert_packing": "4"},
        # the copies add up in micro-ops during the backward, across the expert groups too
        "packing-lina": {"expert_packing": "4", "grad_sync": "lina", "microop_mb": 0.002},
    }
    for name, settings in techniques.items():
        run_training(tiny(tmp_path / name, **dropless, ep_size=2, **settings), report=False)
        assert losses(tmp_path / name) == pytest.approx(expected, rel=1e-6), name
        records = list(iterate_records(tmp_path / name))
        if "redundant_experts" in settings:  # the slots moved
            assert any(record["rebalanced_blocks"] for record in records), name
    shadowed = [layer["shadowed"] for record in iterate_records(tmp_path / "shadowing") for layer in record["moe"]]
    assert any(shadowed)
    assert records[-1]["packing"]["experts_per_worker"] == 4


@pytest.mark.distributed
def test_tensor_parallel_attention_on_expert_groups_of_two_trains_the_two_worker_model(
    two_worker_run: Path, tmp_path: Path
) -> None:
    """--workers 4 --mp-size 2 --ep-size 2: two expert groups, each one tensor-parallel group (the
    heads over its 2 workers, every expert in 2 hidden shards under S2), copies of each other: the
    2-worker run's losses step for step. The heads' gradients are averaged over the workers holding
    the same heads in the other group (before the fix, only inside the expert group)."""
    run_dir = tmp_path / "mp-ep"
    summary = run_training(tiny(run_dir, workers=4, mp_size=2, ep_size=2, parallel="s2", stop_at=6), report=False)
    assert summary["ep_size"] == 2
    expected = losses(two_worker_run)
    got = losses(run_dir)
    assert list(got) == [1, 2, 3, 4, 5, 6]
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    # its checkpoint (each expert's hidden shards written once) evaluates on one worker as the 2-worker run's
    on_one = run_distributed(_evaluate_checkpoint, 1, str(run_dir / "checkpoints" / "step-000006"))[0]
    reference = run_distributed(_evaluate_checkpoint, 1, str(two_worker_run / "checkpoints" / "step-000006"))[0]
    assert on_one == pytest.approx(reference, rel=1e-5)


def test_a_topology_aware_option_on_one_node_is_warned_about(tmp_path: Path) -> None:
    import warnings
    from types import SimpleNamespace

    from moeflow.comm.topology import Topology
    from moeflow.training.trainer import warn_one_node

    config = tiny(tmp_path, alltoall="pairwise", pipeline="smart")
    with pytest.warns(UserWarning, match="--alltoall pairwise, --pipeline smart: the expert group's 4 workers sit "
                                         "on one node.*--ranks-per-node"):
        warn_one_node(config, SimpleNamespace(size=4, topology=Topology(4, 4)))  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_one_node(config, SimpleNamespace(size=4, topology=Topology(4, 2)))  # type: ignore[arg-type]
        warn_one_node(tiny(tmp_path), SimpleNamespace(size=4, topology=Topology(4, 4)))  # type: ignore[arg-type]


def test_a_checkpoint_of_the_single_file_format_still_loads(tmp_path: Path) -> None:
    """The format before sharded checkpoints: full tensors in model.safetensors and
    optimizer.safetensors; each rank slices its part."""
    from safetensors.torch import save_file

    config = tiny(tmp_path, workers=1)
    torch.manual_seed(0)
    saved = MoETransformer(config.model_config(vocab_size=64))
    folder = tmp_path / "step-000003"
    folder.mkdir()
    save_file({name: t.contiguous() for name, t in saved.state_dict().items()}, str(folder / "model.safetensors"))
    moments = {f"{name}.{m}": torch.full_like(p, 0.5) for name, p in saved.named_parameters()
               for m in ("exp_avg", "exp_avg_sq")}
    steps = {f"{name}.step": torch.tensor([3.0]) for name, _ in saved.named_parameters()}
    save_file({**moments, **steps}, str(folder / "optimizer.safetensors"))
    (folder / "state.json").write_text(json.dumps({"step": 3, "config": config.to_dict()}))
    torch.manual_seed(1)
    loaded = MoETransformer(config.model_config(vocab_size=64))
    optimizer = torch.optim.AdamW(loaded.parameters())
    assert load_checkpoint(folder, loaded, optimizer, 0, 1)["step"] == 3
    assert all(torch.equal(t, saved.state_dict()[n]) for n, t in loaded.state_dict().items())
    assert all(float(s["step"]) == 3 and bool((s["exp_avg"] == 0.5).all()) for s in optimizer.state.values())
    assert len(optimizer.state) == len(list(loaded.parameters()))


@pytest.mark.distributed
def test_checkpoints_move_between_expert_parallel_and_replicated_experts(
    two_worker_run: Path, tmp_path: Path
) -> None:
    from_expert_parallel = str(latest_checkpoint(two_worker_run))
    recorded = list(iterate_records(two_worker_run))[-1]["val_loss"]
    assert run_distributed(_evaluate_checkpoint, 2, from_expert_parallel, "replicated")[0] == pytest.approx(
        recorded, rel=1e-5
    )
    run_training(tiny(tmp_path / "replicated", parallel="replicated", steps=4, checkpoint_interval=4), report=False)
    from_replicated = str(latest_checkpoint(tmp_path / "replicated"))
    on_replicated = run_distributed(_evaluate_checkpoint, 2, from_replicated, "replicated")[0]
    assert run_distributed(_evaluate_checkpoint, 2, from_replicated, "expert")[0] == pytest.approx(
        on_replicated, rel=1e-5
    )
    records = list(iterate_records(tmp_path / "replicated"))
    assert {layer["schedule"] for layer in records[-1]["moe"]} == {"replicated"}


@pytest.mark.distributed
def test_sharded_experts_train_resume_and_reshard_across_r_and_workers(tmp_path: Path) -> None:
    """One expert on 2 workers: each holds half its hidden units (Tutel's W > E layout). A run at
    r = 2 (EP+MP) evaluates the same on 1 worker and at r = 0 (ZeRO-style DP), and goes on at r = 0."""
    sharded = {"num_experts": 1, "top_k": 1, "steps": 4, "checkpoint_interval": 4}
    run_training(tiny(tmp_path / "r2", parallel=2, **sharded), report=False)
    records = list(iterate_records(tmp_path / "r2"))
    assert {layer["r"] for layer in records[-1]["moe"]} == {2}
    checkpoint = str(latest_checkpoint(tmp_path / "r2"))
    at_r2 = run_distributed(_evaluate_checkpoint, 2, checkpoint, 2)[0]
    assert run_distributed(_evaluate_checkpoint, 2, checkpoint, 0)[0] == pytest.approx(at_r2, rel=1e-5)
    assert run_distributed(_evaluate_checkpoint, 1, checkpoint, "expert")[0] == pytest.approx(at_r2, rel=1e-5)
    summary = run_training(
        tiny(tmp_path / "r2", parallel=0, **{**sharded, "steps": 6}), latest_checkpoint(tmp_path / "r2"), report=False
    )
    assert summary["workers"] == 2 and list(losses(tmp_path / "r2")) == list(range(1, 7))


@pytest.mark.distributed
def test_tensor_parallel_attention_trains_as_data_parallel_and_resumes_switching_s1_s2(
    two_worker_run: Path, tmp_path: Path
) -> None:
    """4 workers with --mp-size 2 are 2 data-parallel replicas of heads split over 2 workers, the
    MoE layers behind them on Parm's schedules: the same losses as the 2-worker run step for step,
    under S2 with every expert in 4 hidden shards (N_ESP = 4), and resumed under auto (S1 and S2
    chosen per step, both on the whole routing) with N_ESP = N_MP = 2 (the checkpoint re-sharded).
    (A fixed S1 routes each member's partition, so where capacity binds it drops other tokens than
    the 2-worker run: the equivalence table checks it against the reference.) Its checkpoint holds
    full tensors: it evaluates on 1 worker without tensor parallelism as the 2-worker run's does."""
    run_dir = tmp_path / "mp"
    run_training(tiny(run_dir, workers=4, mp_size=2, esp_size=4, parallel="s2", stop_at=6), report=False)
    records = list(iterate_records(run_dir))
    assert {layer["schedule"] for layer in records[-1]["moe"]} == {"s2"}
    step6 = run_dir / "checkpoints" / "step-000006"
    at_one = run_distributed(_evaluate_checkpoint, 1, str(step6))[0]
    reference = run_distributed(_evaluate_checkpoint, 1, str(two_worker_run / "checkpoints" / "step-000006"))[0]
    assert at_one == pytest.approx(reference, rel=1e-5)
    run_training(tiny(run_dir, workers=4, mp_size=2, parallel="auto"), latest_checkpoint(run_dir), report=False)
    schedules = {layer["schedule"] for record in iterate_records(run_dir) for layer in record["moe"]}
    assert schedules == {"s1", "s2"}
    expected = losses(two_worker_run)
    assert list(losses(run_dir)) == list(range(1, 13))
    for step, loss in losses(run_dir).items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.distributed
def test_generate_and_report_from_a_run(two_worker_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.cli import main

    assert main(["generate", "--checkpoint", str(two_worker_run), "--prompt", "def ", "--tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > 8
    # the experts over 2 workers, each reading only its own: the same tokens
    assert main(["generate", "--checkpoint", str(two_worker_run), "--prompt", "def ", "--tokens", "12",
                 "--workers", "2"]) == 0
    assert capsys.readouterr().out == text
    (two_worker_run / "loss.png").unlink()
    assert main(["report", str(two_worker_run)]) == 0
    assert (two_worker_run / "loss.png").exists()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["steps"] == 12


@pytest.mark.distributed
def test_export_writes_the_full_model_one_layer_per_shard(two_worker_run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """moeflow export of a 2-worker checkpoint: safetensors shards per block with transformers'
    index, the experts whole; loaded into one process's model it computes the recorded loss."""
    from safetensors.torch import load_file

    from moeflow.cli import main
    from moeflow.data import PreparedCorpus

    assert main(["export", str(two_worker_run), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert summary["shards"] == len(set(index["weight_map"].values())) == 3  # 2 blocks and the rest
    tensors = {name: tensor for shard in set(index["weight_map"].values())
               for name, tensor in load_file(tmp_path / "out" / shard).items()}
    state = read_state(latest_checkpoint(two_worker_run))
    config = TrainConfig(**state["config"]).updated({"workers": 1})
    corpus = PreparedCorpus(**state["corpus"])
    model = MoETransformer(config.model_config(corpus.vocab_size))
    assert tensors["blocks.1.ffn.experts.w1"].shape[0] == config.num_experts
    model.load_state_dict(tensors, strict=True)
    loss = evaluate(model, corpus.load("val"), config, 0, 1, None, torch.device("cpu"))
    assert loss == pytest.approx(list(iterate_records(two_worker_run))[-1]["val_loss"], rel=1e-5)
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


# -- faults and bad input ------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


@pytest.mark.distributed
@pytest.mark.parametrize(("fault", "named", "within_s"), [
    (signal.SIGKILL, "died with exit code -9", 30),
    (signal.SIGSTOP, "is stopped", 5 + 10),  # a stuck worker: the others time out (5 s), the job ends
])
def test_a_killed_or_stopped_worker_fails_the_job_fast_and_keeps_the_checkpoint(
    tmp_path: Path, fault: signal.Signals, named: str, within_s: float
) -> None:
    run_dir = tmp_path / "killed"
    flags = _tiny_flags(run_dir, steps=100_000, checkpoint_interval=2, eval_interval=100_000, collective_timeout_s=5)
    process = subprocess.Popen(
        [sys.executable, "-m", "moeflow", "train", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while latest_checkpoint(run_dir) is None:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        workers = [p for p in _children(process.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2
        os.kill(max(workers), fault)
        killed_at = time.monotonic()
        _, stderr = process.communicate(timeout=60)
        assert time.monotonic() - killed_at < within_s
        assert not any(Path(f"/proc/{worker}").exists() for worker in workers)  # none left behind
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert re.search(f"worker [01] of 2 {named}", stderr), stderr[-3000:]
    checkpoint = latest_checkpoint(run_dir)
    model = MoETransformer(TrainConfig(**read_state(checkpoint)["config"]).model_config(512))
    assert read_state(checkpoint)["step"] % 2 == 0
    load_checkpoint(checkpoint, model, None, rank=0, world_size=1)  # intact: loads completely


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-experts", "6", "--workers", "4"], "num_experts=6 is not divisible by workers=4"),
        (["--heads", "3"], "model_dim=256 is not divisible by heads=3"),
        (["--top-k", "9"], "top_k"),
        (["--data", "/nonexistent/corpus"], "data path '/nonexistent/corpus' does not exist"),
        (["--steps", "5", "--stop-at", "9"], "stop_at must be a step in"),
        (["--parallel", "s2"], "add --mp-size N"),
        (["--mp-size", "3"], "workers=2 is not a multiple of mp_size=3"),
        (["--mp-size", "2", "--heads", "1", "--model-dim", "64"], "heads=1 cannot be split over mp_size=2"),
        (["--mp-size", "2", "--parallel", "expert"], "does not run behind tensor-parallel attention"),
        (["--mp-size", "2", "--workers", "4", "--num-experts", "3"], "over 2 expert-parallel groups"),
        (["--esp-size", "2"], "set --mp-size > 1 too"),
        (["--workers", "4", "--ep-size", "3"], "workers=4 is not a multiple of ep_size=3"),
        (["--workers", "4", "--ep-size", "2", "--num-experts", "3"], "num_experts=3 is not divisible by ep_size=2"),
        (["--workers", "4", "--ranks-per-node", "3"], "workers=4 is not a multiple of ranks_per_node=3"),
        (["--workers", "4", "--ep-size", "2", "--parallel", "replicated"], "--ep-size has nothing to split"),
        (["--workers", "8", "--ep-size", "2", "--mp-size", "4"], "ep_size=2 is not a multiple of mp_size=4"),
        (["--workers", "4", "--ep-size", "2", "--mp-size", "2", "--esp-size", "4"],
         "esp_size=4 hidden shards per expert must divide ep_size=2"),
        (["--mp-size", "2", "--esp-size", "3"], "esp_size=3 hidden shards per expert must divide workers=2"),
        (["--mp-size", "2", "--parallel", "ds-baseline", "--esp-size", "2"], "or esp_size=None"),
        (["--parallel", "3"], "not a valid r"),
        (["--num-experts", "3", "--workers", "4", "--parallel", "adaptive"], "not a multiple of it"),
    ],
)
def test_bad_input_fails_before_any_worker_starts(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moeflow.cli import main

    assert main(["train", "--run-dir", str(tmp_path / "run"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_config_files_unknown_keys_and_flag_precedence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.cli import build_parser
    from moeflow.commands.train import train_config_from_args

    (tmp_path / "a.toml").write_text('[train]\nlayers = 2\nmodel_dim = 64\npipeline = "search"\n')
    (tmp_path / "b.yaml").write_text("layers: 3\nnum_experts: 4\n")
    (tmp_path / "bad.toml").write_text("layer = 2\n")
    parse = build_parser().parse_args
    config, _ = train_config_from_args(parse(["train", "--config", str(tmp_path / "a.toml"), "--layers", "5"]))
    assert (config.layers, config.model_dim, config.pipeline) == (5, 64, "search")
    config, _ = train_config_from_args(parse(["train", "--config", str(tmp_path / "b.yaml"), "--pipeline", "2"]))
    assert (config.layers, config.num_experts, config.pipeline) == (3, 4, 2)
    from moeflow.cli import main

    assert main(["train", "--config", str(tmp_path / "bad.toml")]) == 2
    assert "unknown config file" in (err := capsys.readouterr().err) and "did you mean 'layers'" in err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no checkpoint found" in capsys.readouterr().err


def test_the_old_ffn_hidden_setting_still_reads_with_a_warning(tmp_path: Path) -> None:
    from moeflow.cli import build_parser
    from moeflow.commands.train import train_config_from_args
    from moeflow.training.config import checked_keys

    parse = build_parser().parse_args
    with pytest.warns(FutureWarning, match="--ffn-hidden is renamed --hidden-dim"):
        args = parse(["train", "--ffn-hidden", "64"])
    config, _ = train_config_from_args(args)
    assert config.hidden_dim == 64 and config.model_config(512).moe.hidden_dim == 64
    with pytest.warns(FutureWarning, match="'ffn_hidden' is renamed 'hidden_dim'") as caught:
        saved = checked_keys({"ffn_hidden": 32, "layers": 2}, "checkpoint")  # a saved run's config
    assert saved == {"hidden_dim": 32, "layers": 2} and len(caught) == 1
    with pytest.raises(ValueError, match="both 'ffn_hidden' and 'hidden_dim' are given"):
        checked_keys({"ffn_hidden": 32, "hidden_dim": 64})
    (tmp_path / "old.toml").write_text("[train]\nffn_hidden = 48\n")
    with pytest.warns(FutureWarning, match="ffn_hidden"):
        config, _ = train_config_from_args(parse(["train", "--config", str(tmp_path / "old.toml")]))
    assert config.hidden_dim == 48


def _tiny_flags(run_dir: Path, **changes: Any) -> list[str]:
    values = {**TINY, "run_dir": str(run_dir), **changes}
    values.pop("progress")
    return [f"--{key.replace('_', '-')}={value}" for key, value in values.items()] + ["--no-progress"]


@pytest.mark.distributed
def test_train_runs_under_torchrun_as_the_launched_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29631",
         "-m", "moeflow", "train", *_tiny_flags(tmp_path / "run", steps=4, pipeline="auto", alltoall="auto")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"summary"')]
    assert len(summaries) == 1 and summaries[0]["workers"] == 2 and summaries[0]["steps"] == 4
    assert list(losses(tmp_path / "run")) == [1, 2, 3, 4] and (tmp_path / "run" / "loss.png").exists()


def test_the_default_models_moe_layer_is_moeconfigs_default_for_it() -> None:
    from dataclasses import replace

    from moeflow.config import model_moe_defaults
    from moeflow.training.config import TrainConfig

    config = TrainConfig()
    built = config.model_config(vocab_size=64).moe
    assert built == replace(model_moe_defaults(), tokens_per_rank_hint=config.batch_size * config.context)


@pytest.mark.distributed
def test_mixed_precision_trains_and_fp16_resumes_exactly(tmp_path: Path) -> None:
    """--dtype bf16/fp16: autocast over fp32 master weights (the checkpoint holds fp32); the loss
    falls; fp16 scales the loss and its scaler's state travels in the checkpoint (exact resume)."""
    run_training(tiny(tmp_path / "bf16", dtype="bf16"), report=False)
    bf16 = losses(tmp_path / "bf16")
    assert all(math.isfinite(loss) for loss in bf16.values()) and bf16[12] < bf16[1] - 0.5
    saved = saved_tensors(latest_checkpoint(tmp_path / "bf16"))
    assert {md.properties.dtype for key, md in saved.items() if key.startswith("model.")} == {torch.float32}

    run_training(tiny(tmp_path / "fp16", dtype="fp16"), report=False)
    run_training(tiny(tmp_path / "fp16-resumed", dtype="fp16", stop_at=5, checkpoint_interval=100), report=False)
    state = json.loads((latest_checkpoint(tmp_path / "fp16-resumed") / "state.json").read_text())
    assert state["grad_scaler"]["scale"] > 1
    run_training(tiny(tmp_path / "fp16-resumed", dtype="fp16"), latest_checkpoint(tmp_path / "fp16-resumed"),
                 report=False)
    fp16 = losses(tmp_path / "fp16")
    assert losses(tmp_path / "fp16-resumed") == fp16 and fp16[12] < fp16[1] - 0.5
    assert all(r["loss_scale"] > 1 for r in iterate_records(tmp_path / "fp16"))


@pytest.mark.parametrize("expert_sq_global", [float("inf"), 8.0])
def test_fp16_overflow_on_another_rank_skips_the_step_on_this_one(expert_sq_global: float) -> None:
    """Each rank's scaler sees only its own expert gradients: a non-finite global norm (another
    rank overflowed) must make this rank skip the step and back the scale off too."""
    from types import SimpleNamespace

    from moeflow.training.trainer import unscale_gradients

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    before = model.weight.detach().clone()
    unscaled_sq = unscale_gradients(SimpleNamespace(model=model, optimizer=optimizer, scaler=scaler), expert_sq_global)
    scaler.step(optimizer)
    scaler.update()
    if math.isfinite(expert_sq_global):
        assert unscaled_sq == expert_sq_global / 16 and not torch.equal(model.weight, before)
        assert scaler.get_scale() == 4.0
    else:
        assert torch.equal(model.weight, before) and scaler.get_scale() == 2.0
