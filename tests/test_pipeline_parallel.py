"""Pipeline parallelism (issue 81): a MoETransformer in stages over the ``pp`` dimension of a mesh,
run by torch.distributed.pipelining's schedules, equals the one-process model trained on the same
micro-batches (losses, gradient norms and parameters after 3 AdamW steps, fp32, dropless, aux loss
and loss-free balancing on, clipping that binds)."""

from __future__ import annotations

import dataclasses
import statistics
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from moeflow.models.transformer import MoETransformer, TransformerConfig
from moeflow.pipeline import StageSplit, pipeline_stages, schedule_named
from moeflow.pipeline.build import lm_loss
from moeflow.pipeline.groups import check_mesh
from pool import run_distributed

STEPS, MICROBATCHES, BATCH = 3, 4, 8
CLIP = 0.05  # below every step's gradient norm (the reference checks): clipping binds
ADAM_EPS = 1e-6  # Adam divides by sqrt(v) + eps: at the default 1e-8 a gradient of ~1e-10 (an expert element few
# tokens reach, the key bias's zero) turns its summation-order rounding into a 1e-5 step difference


def _config(**plan: Any) -> TransformerConfig:
    """``plan``: the MoE layers' pipeline degree and all-to-all, fixed for runs compared bit for bit
    (``auto`` times its candidates, and a chunked plan sums in another order)."""
    return TransformerConfig.build(vocab_size=64, context=8, layers=4, heads=2, model_dim=16, hidden_dim=32,
                                   num_experts=4, top_k=2, capacity_factor=0.0, aux_loss_weight=0.01,
                                   expert_kernel="bmm", expert_bias_update_rate=0.01, **plan)


FIXED_PLAN = {"pipeline": 1, "alltoall": "linear"}


def _batches(replicas: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's tokens: ``BATCH`` sequences for each of ``replicas`` expert-parallel ranks."""
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 64, (BATCH * replicas, 9), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference(replicas: int = 1) -> dict[str, Any]:
    """One process: each step's batch in the same micro-batches (of each of ``replicas`` ranks'
    batches), the mean of their losses (the language model's and the aux losses) backpropagated,
    the balancing bias moved once a step from all of their load."""
    torch.manual_seed(0)
    model = MoETransformer(_config(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    losses, norms = [], []
    for idx, targets in _batches(replicas):
        total = 0.0
        for layer in model.moe_layers():
            layer.hold_bias_updates()
        for replica in range(replicas):
            rows = slice(replica * BATCH, (replica + 1) * BATCH)
            for idx_mb, targets_mb in zip(idx[rows].chunk(MICROBATCHES), targets[rows].chunk(MICROBATCHES),
                                          strict=True):
                _, loss = model(idx_mb, targets_mb)
                (loss / (MICROBATCHES * replicas)).backward()
                total += float(loss.detach()) / (MICROBATCHES * replicas)
        for layer in model.moe_layers():
            layer.release_bias_updates()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    assert min(norms) > CLIP  # the clipping binds
    biases = {f"blocks.{i}.ffn.gate.expert_bias": model.blocks[i].moe.gate.expert_bias.clone()
              for i in model.moe_block_indices()}
    assert all(bias.abs().sum() > 0 for bias in biases.values())  # the balancing moved them
    return {"losses": losses, "norms": norms, "biases": biases,
            "parameters": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(rank: int, world_size: int, schedule: str, dp_size: int = 1, ep_size: int = 1,
               checkpointed: bool = False, overlap: bool | None = None, plan: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    torch.manual_seed(0)
    pp_size = world_size // (dp_size * ep_size)
    mesh = init_device_mesh("cpu", (pp_size, dp_size, ep_size), mesh_dim_names=("pp", "dp", "ep"))
    pipeline = pipeline_stages(_config(**plan or {}), mesh, schedule=schedule, microbatches=MICROBATCHES,
                               batch_size=BATCH, activation_checkpointing=checkpointed, overlap=overlap)
    model = pipeline.model
    backward_threads: set[str] = set()  # the threads the MoE layers' backwards ran in

    def note_backward_thread(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda _grad: backward_threads.add(threading.current_thread().name.split()[0]))

    for layer in model.moe_layers():
        layer.register_forward_hook(note_backward_thread)
    optimizer = torch.optim.AdamW(list(pipeline.parameters()), lr=1e-2, eps=ADAM_EPS)
    losses, norms, replica = [], [], mesh.get_local_rank("dp") * ep_size + mesh.get_local_rank("ep")
    for idx, targets in _batches(dp_size * ep_size):
        rows = slice(replica * BATCH, (replica + 1) * BATCH)
        losses.append(pipeline.step(idx[rows], targets[rows]))
        norms.append(pipeline.clip_gradients(CLIP))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    held = {name: p.detach().clone() for name, p in pipeline.named_parameters()}
    if ep_size > 1:  # each rank's experts are its share: the whole ones are compared
        held = {name: p for name, p in held.items() if name not in model.expert_parameter_names()}
        for index, layer in zip(model.moe_block_indices(), model.moe_layers(), strict=True):  # a collective each
            held |= {f"blocks.{index}.ffn.{name}": value for name, value in layer.full_state_dict().items()
                     if name.startswith("experts.")}
    biases = {f"blocks.{i}.ffn.gate.expert_bias": model.blocks[i].moe.gate.expert_bias.clone()
              for i in model.moe_block_indices()}
    return {"losses": losses, "norms": norms, "parameters": held, "biases": biases,
            "backward_threads": backward_threads, "stages": [stage.index for stage in pipeline.stages],
            "blocks": sorted({int(name.split(".")[1]) for name, _ in pipeline.named_parameters()
                              if name.startswith("blocks.")}),
            "stage_blocks": [list(stage.blocks) for stage in pipeline.stages]}


def _compare(results: list[dict[str, Any]], expected: dict[str, Any], schedule: str, pp_size: int) -> None:
    held = sorted({index for result in results for index in result["stages"]})
    assert held == list(range(schedule_named(schedule).num_stages(pp_size)))
    seen = set()
    for result in results:  # a rank holds parameters of its own stages' blocks only, a part of the model
        assert result["blocks"] == sorted(int(index) for blocks in result["stage_blocks"] for index in blocks)
        assert len(result["blocks"]) == _config().layers // pp_size
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(expected["norms"]), rtol=1e-5,
                                   atol=1e-6)
        for name, bias in result["biases"].items():
            torch.testing.assert_close(bias, expected["biases"][name], rtol=0, atol=0)
        for name, value in result["parameters"].items():
            torch.testing.assert_close(value, expected["parameters"][name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
            seen.add(name)
    assert seen == set(expected["parameters"])  # every parameter is held by some stage


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"])
def test_two_stages_equal_the_one_process_model(schedule: str) -> None:
    _compare(run_distributed(_pipelined, 2, schedule, timeout_s=300), _reference(), schedule, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_two_stages_of_two_expert_parallel_ranks_equal_the_one_process_model(schedule: str) -> None:
    """P 2 x EP 2 on 4 processes: each stage's experts split over its two ranks, which read
    different batches; the one process runs both batches' micro-batches."""
    _compare(run_distributed(_pipelined, 4, schedule, 1, 2, timeout_s=300), _reference(2), schedule, 2)


@pytest.mark.distributed
def test_dualpipev_with_the_overlap_equals_it_without_bit_for_bit_also_with_checkpointing() -> None:
    """P 2 x EP 2 under DualPipeV, every block recomputed in the backward (what torchtitan's overlap
    did not compose with): each paired backward runs in a second thread beside the forward, its
    stage's MoE layers on their own expert group, and the run equals the same schedule taking one
    action at a time bit for bit (the same operations on the same values, each gradient summed in
    the same order), and the one-process model."""
    overlapped, one_at_a_time = (run_distributed(_pipelined, 4, "dualpipev", 1, 2, True, overlap, FIXED_PLAN,
                                                                 timeout_s=300)
                                 for overlap in (None, False))
    for paired, alone in zip(overlapped, one_at_a_time, strict=True):
        assert paired["backward_threads"] == {"MainThread", "pipeline"}  # some ran beside a forward
        assert alone["backward_threads"] == {"MainThread"}
        assert (paired["losses"], paired["norms"]) == (alone["losses"], alone["norms"])
        for name, value in paired["parameters"].items():
            torch.testing.assert_close(value, alone["parameters"][name], rtol=0, atol=0, msg=name)
    _compare(overlapped, _reference(2), "dualpipev", 2)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_activation_checkpointing_inside_the_stages_equals_the_one_process_model(schedule: str) -> None:
    """Every block recomputed in the backward, its MoE layers replaying each micro-batch's plan in
    forward order (gpipe: all four forwards before the first backward; zbv: backward split in two)."""
    _compare(run_distributed(_pipelined, 2, schedule, 1, 1, True, timeout_s=300), _reference(), schedule, 2)


@pytest.mark.distributed
def test_two_stages_of_two_data_parallel_copies_equal_the_one_process_model() -> None:
    """P 2 x DP 2 on 4 processes: each stage copied on two ranks reading different batches."""
    _compare(run_distributed(_pipelined, 4, "interleaved", 2, 1, timeout_s=300), _reference(2), "interleaved", 2)


def test_the_split_is_even_or_as_given_and_refuses_what_cannot_run() -> None:
    assert [list(r) for r in StageSplit.of(5, 2).blocks] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in StageSplit.of(4, 2, [1, 3]).blocks] == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="at least one block"):
        StageSplit.of(3, 4)
    with pytest.raises(ValueError, match="4 blocks in all"):
        StageSplit.of(4, 2, [1, 2])
    with pytest.raises(ValueError, match="pp_schedule='zb' is unknown"):
        schedule_named("zb")
    with pytest.raises(ValueError, match=r"'pp' first, got \('ep', 'pp'\)"):
        check_mesh(SimpleNamespace(mesh_dim_names=("ep", "pp")))
    with pytest.raises(ValueError, match=r"got \('pp', 'tp'\)"):
        check_mesh(SimpleNamespace(mesh_dim_names=("pp", "tp")))


def test_a_stage_names_each_forward_so_that_its_recomputes_find_its_record() -> None:
    """A recompute takes its forward's record: in one model the latest (backwards run in reverse);
    in a pipeline's stage the one of its name, whatever the order of the backwards and however
    often it recomputes (a zero-bubble backward in two parts recomputes twice), the names of a
    step's micro-batches kept beyond the usual few."""
    from moeflow.moe.forward_memory import KEPT, ForwardMemory

    memory = ForwardMemory()
    records = [memory.start(False, torch.tensor([float(i)])) for i in range(3)]
    assert memory.start(True, None) is records[-1]
    memory, calls = ForwardMemory(), KEPT + 4
    records = []
    for name in range(calls):
        with memory.call(name, calls):
            records.append(memory.start(False, torch.tensor([float(name)])))
    for name in [0, 0, 5, 1, 1, calls - 1]:  # in forward order, each twice, or out of it
        with memory.call(name, calls):
            assert memory.start(True, None) is records[name]


def _evaluated(rank: int, world_size: int, config: TransformerConfig) -> float:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    pipeline = pipeline_stages(config, mesh, schedule="1f1b", microbatches=MICROBATCHES, batch_size=BATCH)
    idx, targets = _batches()[0]
    return pipeline.evaluate(idx, targets)


@pytest.mark.distributed
def test_evaluation_runs_the_stages_in_eval_mode_with_the_evaluation_capacity() -> None:
    """Trained at a capacity factor that drops tokens, evaluated dropless (the config's evaluation
    factor) as the one-process model is."""
    config = dataclasses.replace(_config(), moe=dataclasses.replace(_config().moe, capacity_factor=0.5))
    model = MoETransformer(config, seed=0).eval()
    idx, targets = _batches()[0]
    with torch.no_grad():  # the language model's loss (the aux losses are training's), a mean over micro-batches
        chunks = zip(idx.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True)
        expected = statistics.fmean(float(lm_loss(model(i)[0], t)) for i, t in chunks)
    for loss in run_distributed(_evaluated, 2, config, timeout_s=300):
        assert loss == pytest.approx(expected, rel=1e-5)
