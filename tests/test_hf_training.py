"""`moeflow train --hf DIR`: fine-tuning a transformers MoE model with the trainer. The first step's
loss is transformers' own on the same batches, the transformers checkpoint written at the end holds
the trained weights (plain transformers gives the run's validation loss), fine-tuning lowers the
loss, a resumed run repeats an uninterrupted one, and bad input fails before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hf_models import tiny_model, word_tokenizer
from moeflow.cli import main
from moeflow.data import PreparedCorpus
from moeflow.training import TrainConfig
from moeflow.training.batches import token_windows, training_batch, validation_windows
from moeflow.training.launch import run_training
from moeflow.training.metrics import iterate_records

FINE_TUNE: dict[str, Any] = dict(
    context=16, batch_size=4, steps=24, eval_interval=12, eval_windows=8, checkpoint_interval=12, warmup_steps=2,
    lr=1e-2, min_lr=1e-3, pipeline=1, alltoall="linear", progress=False,
    expert_kernel="bmm",  # runs compared bit for bit: expert_kernel='auto' probes each run's own rates
)


def _saved(directory: Path, family: str, tokenizer: bool = True, **overrides: Any) -> Path:
    model = tiny_model(family, seed=1, **overrides)
    model.config.eos_token_id = 2
    model.save_pretrained(directory)
    if tokenizer:
        word_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lines of words w3..w95 where each word determines the next: a pattern worth learning."""
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        word, line = rng.randrange(3, 96), []
        for _ in range(24):
            line.append(f"w{word}")
            word = (word * 7 + 3) % 93 + 3
        lines.append(" ".join(line))
    path = tmp_path_factory.mktemp("data") / "words.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(tmp_path_factory.mktemp("mixtral"), "mixtral")


def _plain(directory: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _cross_entropy(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@torch.no_grad()
def _first_step_loss(model: torch.nn.Module, corpus: PreparedCorpus, config: TrainConfig) -> float:
    """The trainer's step-1 loss: the mean over the workers of each one's batch's cross-entropy."""
    stream = corpus.load("train")
    losses = []
    for rank in range(config.workers):
        inputs, targets = training_batch(stream, 1, rank, config.workers, config.seed, config.batch_size,
                                         config.context)
        losses.append(float(_cross_entropy(model, torch.cat([inputs, targets[:, -1:]], dim=1))))
    return sum(losses) / len(losses)


@torch.no_grad()
def _validation_loss(model: torch.nn.Module, corpus: PreparedCorpus, config: TrainConfig) -> float:
    stream = corpus.load("val")
    windows = token_windows(stream, validation_windows(stream, config.eval_windows, config.context), config.context)
    return float(_cross_entropy(model, windows))


@pytest.mark.distributed
def test_fine_tuning_starts_from_the_model_and_writes_its_trained_weights(
    mixtral_dir: Path, corpus_file: Path, tmp_path: Path
) -> None:
    config = TrainConfig(**FINE_TUNE, hf=str(mixtral_dir), data=str(corpus_file), run_dir=str(tmp_path / "run"))
    summary = run_training(config)
    records = list(iterate_records(tmp_path / "run"))
    corpus = PreparedCorpus(**json.loads((tmp_path / "run" / "corpus.json").read_text()))
    assert corpus.tokenizer == "pretrained" and corpus.vocab_size == 96

    before, after = _plain(mixtral_dir), _plain(Path(summary["hf_checkpoint"]))
    assert records[0]["loss"] == pytest.approx(_first_step_loss(before, corpus, config), rel=1e-5)
    assert summary["val_loss"] == pytest.approx(_validation_loss(after, corpus, config), rel=1e-5)
    assert summary["val_loss"] < _validation_loss(before, corpus, config) - 0.5  # it learned the pattern
    for record in records:
        assert record["aux_loss"] == 0.0  # the model's config adds no router loss
        assert [layer["block"] for layer in record["moe"]] == [0, 1]
        assert all(layer["dropped"] == 0 for layer in record["moe"])  # dropless, as the model was trained
        assert all(sum(layer["tokens_per_expert"]) == 2 * 4 * 16 * 2 for layer in record["moe"])
    assert (tmp_path / "run" / "hf" / "tokenizer.json").is_file()
    assert (tmp_path / "run" / "loss.png").is_file()
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    assert resolved["lr"] == {"value": 1e-2, "from": "--lr"}
    assert resolved["aux_loss_weight"]["value"] == 0.0 and "output_router_logits" in resolved["aux_loss_weight"]["from"]
    assert resolved["capacity_factor"] == {"value": 0.0, "from": "dropless, as the model was trained"}


def test_fine_tuning_starts_at_a_fine_tuning_learning_rate_and_says_where_each_setting_came_from(
    mixtral_dir: Path
) -> None:
    """Unset, --hf's learning rates are transformers' Trainer's (a from-scratch rate collapsed a
    fine-tuned router within 10 steps); a given --lr ends its schedule at a tenth of itself."""
    from moeflow.training.config import FINE_TUNING_LR, SCRATCH_LR
    from moeflow.training.hf_model import model_settings, read_hf_info

    fine_tuning, scratch = TrainConfig(hf=str(mixtral_dir)), TrainConfig()
    assert (fine_tuning.peak_lr, fine_tuning.final_lr) == FINE_TUNING_LR == (5e-5, 5e-6)
    assert (scratch.peak_lr, scratch.final_lr) == SCRATCH_LR == (3e-3, 3e-4)
    assert (TrainConfig(lr=1e-3).final_lr, TrainConfig(lr=1e-3, min_lr=0.0).final_lr) == (1e-4, 0.0)
    assert fine_tuning.resolved()["lr"]["from"] == "the fine-tuning default (transformers' Trainer's)"
    info = read_hf_info(mixtral_dir)
    balanced = model_settings(TrainConfig(hf=str(mixtral_dir), aux_loss_weight=0.01), info)
    assert balanced["aux_loss_weight"] == {"value": 0.01, "from": "--aux-loss-weight"}
    assert model_settings(fine_tuning, info)["aux_loss_weight"]["value"] == 0.0  # the config turns no loss on
    coefficient = dataclasses.replace(info, router_aux_loss_coef=0.02)
    assert model_settings(fine_tuning, coefficient)["aux_loss_weight"]["value"] == 0.0
    turned_on = TrainConfig(hf=str(mixtral_dir), aux_loss_weight="model")  # the user turns the model's own on
    assert model_settings(turned_on, coefficient)["aux_loss_weight"] == {
        "value": 0.02, "from": "the model's router_aux_loss_coef (--aux-loss-weight model)"}
    by_config = dataclasses.replace(coefficient, adds_router_loss=True)
    assert model_settings(fine_tuning, by_config)["aux_loss_weight"]["value"] == 0.02
    with pytest.raises(ValueError, match="sets none: give a number"):
        model_settings(turned_on, dataclasses.replace(info, router_aux_loss_coef=0.0))
    with pytest.raises(ValueError, match="takes a --hf model's router_aux_loss_coef: give --hf, or a number"):
        TrainConfig(aux_loss_weight="model")
    with pytest.raises(ValueError, match=r"min_lr=0\.001 exceeds lr=0\.0001"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


@pytest.mark.distributed
def test_fine_tuning_resumes_exactly(corpus_file: Path, tmp_path: Path) -> None:
    """DeepSeek-V3 (a dense first block, shared experts, a selection bias) with a router loss."""
    directory = _saved(tmp_path / "deepseek", "deepseek_v3")
    settings = dict(FINE_TUNE, steps=6, checkpoint_interval=3, eval_interval=3, aux_loss_weight=0.01,
                    hf=str(directory), data=str(corpus_file))
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "whole")), report=False)
    run_training(TrainConfig(**settings, stop_at=3, run_dir=str(tmp_path / "resumed")), report=False)
    assert not (tmp_path / "resumed" / "hf").exists()  # written when the run ends, not when it pauses
    assert main(["train", "--resume", str(tmp_path / "resumed")]) == 0
    whole, resumed = (list(iterate_records(tmp_path / name)) for name in ("whole", "resumed"))
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [(r["loss"], r["aux_loss"]) for r in resumed] == [(r["loss"], r["aux_loss"]) for r in whole]
    assert all(r["aux_loss"] > 0 and [layer["block"] for layer in r["moe"]] == [1] for r in whole)
    assert (tmp_path / "resumed" / "hf" / "model.safetensors.index.json").is_file()
    _assert_export_equals_save_pretrained(tmp_path / "resumed", tmp_path / "reference")


@pytest.mark.distributed
def test_fine_tuning_with_experts_over_two_of_four_workers_trains_the_four_worker_model(
    mixtral_dir: Path, corpus_file: Path, tmp_path: Path
) -> None:
    """--hf with --ep-size 2 on 4 workers (each expert group loading only its own experts, copies of
    each other over the mesh) takes the steps --workers 4 takes, and writes the same transformers model."""
    settings = dict(FINE_TUNE, steps=3, checkpoint_interval=3, eval_interval=3, workers=4, hf=str(mixtral_dir),
                    data=str(corpus_file))
    for name, ep_size in (("ep4", None), ("ep2", 2)):
        run_training(TrainConfig(**settings, ep_size=ep_size, run_dir=str(tmp_path / name)), report=False)
    ep4, ep2 = (list(iterate_records(tmp_path / name)) for name in ("ep4", "ep2"))
    assert [r["loss"] for r in ep2] == pytest.approx([r["loss"] for r in ep4], rel=1e-5)
    exported, reference = _plain(tmp_path / "ep2" / "hf").state_dict(), _plain(tmp_path / "ep4" / "hf").state_dict()
    assert exported.keys() == reference.keys()
    for name in reference:
        # atol: the layouts sum a gradient in another order, and AdamW divides a near-zero one's rounding by its
        # own tiny second moment, a step of lr's size (seen: 9e-6 on one expert weight in 3 steps)
        torch.testing.assert_close(exported[name], reference[name], rtol=1e-5, atol=2e-5, msg=name)


@pytest.mark.distributed
def test_fine_tuning_with_tensor_parallel_attention_trains_the_data_parallel_model(
    corpus_file: Path, tmp_path: Path
) -> None:
    """--hf --workers 4 --ep-size 2 --mp-size 2: the attention's heads split over pairs of workers by
    the model's own plan (q/k norms and the output bias kept whole), two replicas of them, Parm's
    schedules behind it on each expert group, the gradients reduced during the backward (lina); with
    clipping that binds it takes the steps of --workers 2 (the same two batches), also when stopped
    and resumed (each worker reloads its heads), and writes the same transformers model."""
    directory = _saved(tmp_path / "qwen", "qwen3_moe", attention_bias=True)
    settings = dict(FINE_TUNE, steps=4, checkpoint_interval=2, eval_interval=4, grad_clip=0.05, hf=str(directory),
                    data=str(corpus_file))
    run_training(TrainConfig(**settings, workers=2, run_dir=str(tmp_path / "dp")), report=False)
    run_training(TrainConfig(**settings, workers=4, ep_size=2, mp_size=2, grad_sync="lina", stop_at=2,
                             run_dir=str(tmp_path / "mp")), report=False)
    assert main(["train", "--resume", str(tmp_path / "mp")]) == 0
    data_parallel, split = (list(iterate_records(tmp_path / name)) for name in ("dp", "mp"))
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0.05 for r in data_parallel)  # the clipping binds
    for name in ("loss", "grad_norm"):
        assert [r[name] for r in split] == pytest.approx([r[name] for r in data_parallel], rel=1e-5)
    exported, reference = _plain(tmp_path / "mp" / "hf").state_dict(), _plain(tmp_path / "dp" / "hf").state_dict()
    assert exported.keys() == reference.keys()
    for name in reference:  # atol: as for --ep-size above (seen: 5e-5 on one element of an o_proj in 3 steps)
        torch.testing.assert_close(exported[name], reference[name], rtol=1e-5, atol=1e-4, msg=name)


def _assert_export_equals_save_pretrained(run_dir: Path, reference: Path) -> None:
    """The export (one layer at a time from the sharded checkpoint) against transformers' own
    save_pretrained of the same weights (the checkpoint loaded whole in one process): the same
    tensors once plain transformers has loaded either."""
    from moeflow.comm.groups import ParallelGroups
    from moeflow.hf import to_hf
    from moeflow.training.checkpoint import latest_checkpoint, load_checkpoint, read_state
    from moeflow.training.hf_model import build_hf_model

    checkpoint = latest_checkpoint(run_dir)
    config = TrainConfig(**read_state(checkpoint)["config"]).updated({"workers": 1})
    model = build_hf_model(config, ParallelGroups.single_process(), torch.device("cpu"))
    load_checkpoint(checkpoint, model, None, 0, 1)
    to_hf(model.model).save_pretrained(reference)
    exported, saved = _plain(run_dir / "hf").state_dict(), _plain(reference).state_dict()
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "3"], "not divisible by workers=3"),
        (["--workers", "6", "--ep-size", "3"], "not divisible by ep_size=3"),
        (["--mp-size", "2", "--workers", "2", "--parallel", "expert"], "does not run behind tensor-parallel"),
        (["--mp-size", "4", "--workers", "4"], "does not divide mixtral's num_key_value_heads=2"),
        (["--mp-size", "2", "--workers", "6"], "num_experts=4 over 3 expert-parallel groups"),
        (["--context", "500"], "max_position_embeddings=128"),
    ],
)
def test_bad_fine_tuning_input_fails_before_any_worker_starts(
    flags: list[str], message: str, mixtral_dir: Path, corpus_file: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "--hf", str(mixtral_dir), "--data", str(corpus_file), "--run-dir", str(tmp_path / "run"), *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_model_without_tokenizer_or_of_another_architecture_is_refused(
    corpus_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = _saved(tmp_path / "bare", "qwen3_moe", tokenizer=False)
    assert main(["train", "--hf", str(bare), "--data", str(corpus_file), "--run-dir", str(tmp_path / "a")]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert main(["train", "--hf", str(bare), "--data", str(corpus_file), "--run-dir", str(tmp_path / "b")]) == 2
    assert "supported architectures: Mixtral" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["granitemoe", "hunyuan_v1_moe", "glm4_moe", "gpt_oss"])
def test_fine_tuning_runs_the_families_beyond_the_first_four(family: str, corpus_file: Path, tmp_path: Path) -> None:
    """Families whose router lives elsewhere (Granite's ``router``, HunYuan's ``gate.wg``), that copy
    DeepSeek-V3 under another name, or with biases everywhere and clamped experts (gpt-oss): step 1's
    loss is transformers' own, the written checkpoint loads in plain transformers with the run's
    validation loss."""
    from hf_families import tiny_family_model

    directory = tmp_path / family
    model = tiny_family_model(family, seed=1)
    model.config.eos_token_id = 2
    model.save_pretrained(directory)
    word_tokenizer(model.config.vocab_size).save_pretrained(directory)
    config = TrainConfig(**dict(FINE_TUNE, steps=2, eval_interval=2, checkpoint_interval=2), hf=str(directory),
                         data=str(corpus_file), run_dir=str(tmp_path / "run"))
    summary = run_training(config, report=False)
    corpus = PreparedCorpus(**json.loads((tmp_path / "run" / "corpus.json").read_text()))
    first = next(iter(iterate_records(tmp_path / "run")))
    assert first["loss"] == pytest.approx(_first_step_loss(_plain(directory), corpus, config), rel=1e-5)
    assert summary["val_loss"] == pytest.approx(_validation_loss(_plain(Path(summary["hf_checkpoint"])), corpus,
                                                                 config), rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("technique", ["redundant_experts", "shadowing", "expert_packing", "topology_gate"])
def test_fine_tuning_runs_every_technique_on_the_model(technique: str, corpus_file: Path, tmp_path: Path) -> None:
    """EPLB's slots, FasterMoE's shadowing, Lina's packing and the topology gate on a --hf model's
    layers: the exact ones start from transformers' own loss; the gate (which changes the routing)
    limits the tokens leaving a node."""
    from test_train_skew import _profile

    directory = _saved(tmp_path / "qwen", "qwen3_moe")
    settings: dict[str, Any] = {
        "redundant_experts": {"redundant_experts": 2},
        "shadowing": {"shadowing": "auto", "profile": _profile(tmp_path / "profile.json"), "parallel": "expert"},
        "expert_packing": {"expert_packing": 8},
        "topology_gate": {"topology_gate": 0.25, "ranks_per_node": 1},
    }[technique]
    config = TrainConfig(**dict(FINE_TUNE, steps=2, eval_interval=2, checkpoint_interval=2), **settings,
                         hf=str(directory), data=str(corpus_file), run_dir=str(tmp_path / "run"))
    summary = run_training(config, report=False)
    first = next(iter(iterate_records(tmp_path / "run")))
    corpus = PreparedCorpus(**json.loads((tmp_path / "run" / "corpus.json").read_text()))
    expected = _first_step_loss(_plain(directory), corpus, config)
    if technique == "topology_gate":
        assert first["loss"] != pytest.approx(expected, rel=1e-5)  # the gate routes otherwise
    else:  # exact: from transformers' own loss, and the written checkpoint (slots, packing undone) is the model
        assert first["loss"] == pytest.approx(expected, rel=1e-5)
        written = _plain(Path(summary["hf_checkpoint"]))
        assert summary["val_loss"] == pytest.approx(_validation_loss(written, corpus, config), rel=1e-5)
    assert all(sum(layer["tokens_per_expert"]) == 2 * 4 * 16 * 2 for layer in first["moe"])
    if technique == "expert_packing":
        assert first["packing"]["experts_per_worker"] == 8
    if technique == "shadowing":
        assert any(layer["shadowed"] for layer in first["moe"])  # the profile's slow exchange shadows hot experts
    if technique == "redundant_experts":
        assert all(len(layer["tokens_per_expert"]) == 8 for layer in first["moe"])  # per expert, not per slot


def test_the_techniques_are_checked_before_workers_start_against_the_models_own_experts(tmp_path: Path) -> None:
    """The trainer's own expert count (8) is not the model's: on 16 workers a 64-expert model runs
    the expert-parallel schedule, where shadowing, EPLB's slots and packing are allowed; the
    topology gate beside a router that already limits the groups is refused, naming the flag."""
    from moeflow.training.hf_model import check_hf_training, read_hf_info
    from test_train_skew import _profile

    wide = read_hf_info(_saved(tmp_path / "wide", "qwen3_moe", num_experts=64))
    settings: dict[str, Any] = dict(hf=wide.directory, workers=16, parallel="auto")
    for technique in ({"shadowing": "auto", "profile": _profile(tmp_path / "profile.json")},
                      {"redundant_experts": 16}, {"expert_packing": 8}):
        check_hf_training(TrainConfig(**settings, **technique), wide)
    with pytest.raises(ValueError, match="the 64 \\+ 4 expert slots must split evenly over the 16 workers"):
        check_hf_training(TrainConfig(**settings, redundant_experts=4), wide)
    grouped = read_hf_info(_saved(tmp_path / "grouped", "deepseek_v3"))  # n_group 4
    with pytest.raises(ValueError, match="n_group=4\\): use --topology-gate off"):
        check_hf_training(TrainConfig(hf=grouped.directory, topology_gate=0.25), grouped)
