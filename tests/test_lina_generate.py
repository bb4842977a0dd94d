"""``moeflow profile-routing`` and ``moeflow generate --schedule``: the scheduled generation gives
the static placement's tokens, and the profile is checked before it is used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hf_models import greedy_reference, tiny_model, word_tokenizer
from moeflow.cli import main
from moeflow.inference import PROFILE_FILE, RoutingProfile
from moeflow.perf import AlphaBeta, ClusterProfile
from moeflow.training.launch import run_training
from test_training import tiny


def _model_dir(tmp_path: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers) with a word tokenizer and a corpus."""
    import torch

    model = tiny_model("qwen3_moe")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    directory = tmp_path / "model"
    model.save_pretrained(directory)
    word_tokenizer(model.config.vocab_size).save_pretrained(directory)
    words = torch.randint(3, 96, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "corpus.txt").write_text(" ".join(f"w{w}" for w in words))
    prompts = [[int(t) for t in torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 3, 8, 2, 6, 4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    return directory


def _prompts(tmp_path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]


def _generate(tmp_path: Path, capfd: pytest.CaptureFixture[str], workers: int, *extra: str) -> list[list[int]]:
    argv = ["generate", "--hf", str(tmp_path / "model"), "--prompts", str(tmp_path / "prompts.jsonl"),
            "--workers", str(workers), "--max-new-tokens", "6", "--batch-size", "2", *extra]
    code = main(argv)
    out = capfd.readouterr()
    assert code == 0, out.err
    return [json.loads(line)["output_ids"] for line in out.out.splitlines()]


@pytest.mark.distributed
def test_profiled_lina_and_oracle_generate_the_static_tokens(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    directory = _model_dir(tmp_path)
    assert main(["profile-routing", "--hf", str(directory), "--corpus", str(tmp_path / "corpus.txt"),
                 "--tokens", "2048", "--context", "64", "--path-length", "1"]) == 0
    summary = json.loads(capfd.readouterr().out)
    assert summary["tokens"] == 2048 and summary["layers"] == 2 and summary["experts"] == 8
    profile = RoutingProfile.load(directory / PROFILE_FILE)
    assert profile.tables[1][1].tokens.sum() == 2048 and profile.tables[1][1].counts.sum() == 2048 * 2
    static = _generate(tmp_path, capfd, 2)
    assert static == greedy_reference(tiny_model("qwen3_moe"), _prompts(tmp_path), 6, 2)  # transformers' own
    log = tmp_path / "schedule.jsonl"
    assert _generate(tmp_path, capfd, 2, "--schedule", "lina", "--schedule-log", str(log)) == static
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(0 <= r["accuracy"] <= 1 and r["phase2_rate"] == pytest.approx(1 - r["accuracy"]) for r in rounds)
    assert [layer["layer"] for layer in rounds[0]["layers"]] == [0, 1] and rounds[0]["layers"][0]["plans"]
    assert _generate(tmp_path, capfd, 1, "--schedule", "lina") == static
    cluster = tmp_path / "cluster.json"  # a calibrated cluster: the budget's copies are priced on it
    ClusterProfile(nodes=2, ranks_per_node=1, fits={"alltoall.linear": AlphaBeta(1e-4, 1e-9),
                                                     "gemm": AlphaBeta(1e-5, 1e-11)}).save(cluster)
    budget = ["--replica-slots", "1", "--cluster-profile", str(cluster), "--schedule-log", str(log)]
    assert _generate(tmp_path, capfd, 2, "--schedule", "lina", *budget) == static
    assert max(r["max_experts_held"] for r in map(json.loads, log.read_text().splitlines())) <= 4 + 1
    assert _generate(tmp_path, capfd, 2, "--schedule", "oracle", "--max-experts-per-rank", "5") == static


@pytest.mark.slow
def test_a_missing_or_foreign_profile_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    directory = _model_dir(tmp_path)
    base = ["generate", "--hf", str(directory), "--prompts", str(tmp_path / "prompts.jsonl"), "--schedule", "lina"]
    assert main(base) == 2
    assert "no routing profile at" in capfd.readouterr().err
    import numpy as np

    RoutingProfile.from_routes(np.zeros((4, 2, 2), dtype=np.int64), 8, "not-this-model").save(tmp_path / "p.st")
    assert main([*base, "--routing-profile", str(tmp_path / "p.st")]) == 2
    assert "was recorded on another model" in capfd.readouterr().err
    assert main([*base, "--cluster-profile", str(tmp_path / "p.st")]) == 2
    assert "give --replica-slots R too" in capfd.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path), "--schedule", "oracle"]) == 2
    assert "--schedule plans where the experts run per batch" in capfd.readouterr().err
    assert main(["profile-routing", "--hf", str(directory)]) == 2
    assert "--hf needs --corpus" in capfd.readouterr().err


@pytest.mark.distributed
def test_a_checkpoint_is_profiled_on_its_training_split(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run_training(tiny(tmp_path / "run", steps=2, checkpoint_interval=2, eval_interval=2), report=False)
    capfd.readouterr()
    assert main(["profile-routing", "--checkpoint", str(tmp_path / "run"), "--tokens", "512"]) == 0
    summary = json.loads(capfd.readouterr().out)
    assert summary["tokens"] == 512 and summary["layers"] == 2 and Path(summary["profile"]).parent.name == "step-000002"


def _scheduled_logits(rank: int, world_size: int, schedule: str) -> float:
    """transformers' logits against the converted model's under a per-batch schedule (fp64)."""
    import copy

    import numpy as np
    import torch
    import torch.distributed as dist

    from moeflow.hf import moe_blocks, replace_moe_blocks
    from moeflow.inference import InferenceScheduler, SchedulerSettings, schedule_layers

    hf = tiny_model("qwen3_moe", dtype=torch.float64)
    ours = replace_moe_blocks(copy.deepcopy(hf), dist.group.WORLD if world_size > 1 else None, pipeline=1)
    layers = [block.moe for block in moe_blocks(ours)]
    routes = np.random.default_rng(0).integers(0, 8, size=(64, len(layers), 2))  # some estimate, right or wrong
    profile = RoutingProfile.from_routes(routes, 8, "test", path_length=1)
    schedule_layers(layers, InferenceScheduler(SchedulerSettings(schedule), len(layers), profile))
    ids = torch.randint(0, hf.config.vocab_size, (2, 5 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        return (hf(ids).logits - ours(ids).logits).abs().max().item()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("schedule", ["lina", "oracle"])
def test_scheduled_logits_equal_transformers(world_size: int, schedule: str) -> None:
    from pool import run_distributed

    assert max(run_distributed(_scheduled_logits, world_size, schedule, timeout_s=180)) < 1e-10
