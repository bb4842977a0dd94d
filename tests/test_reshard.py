"""Checkpoints reshard across layouts (issue 63): a model and its AdamW state saved at any (EP, DP)
of {(4, 1), (2, 2), (1, 4), (2, 1), (1, 1)} (experts over EP workers, DP copies of those) load at
every other, and saved again there hold the same full tensors, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeflow.comm.collectives import barrier
from moeflow.comm.groups import ParallelGroups
from moeflow.models import MoETransformer
from moeflow.training import TrainConfig
from moeflow.training.checkpoint import load_checkpoint, save_checkpoint
from moeflow.training.gradients import synchronize_gradients
from moeflow.training.optimizer import build_optimizer
from moeflow.training.sharded_checkpoint import read_full_tensors, saved_keys
from moeflow.training.trainer import expert_layout
from pool import run_distributed

LAYOUTS = ((4, 1), (2, 2), (1, 4), (2, 1), (1, 1))
"""(EP, DP): the experts over EP workers, DP copies of them; EP x DP workers."""
VOCAB = 64


def _built(ep: int, workers: int) -> tuple[MoETransformer, torch.optim.Optimizer, object]:
    config = TrainConfig(vocab_size=VOCAB, context=16, layers=2, heads=2, model_dim=16, hidden_dim=32, num_experts=4,
                         top_k=2, pipeline=1, alltoall="linear", capacity_factor=0.0, workers=workers, ep_size=ep,
                         progress=False)
    experts, replicas = expert_layout(config, workers, torch.device("cpu"))
    groups = ParallelGroups.from_group(experts)
    model = MoETransformer(config.model_config(VOCAB), group=groups, seed=0)
    return model, build_optimizer(model, config), replicas


def _save_and_reload(rank: int, world_size: int, tasks: list[tuple[int, str | None, str]]) -> None:
    """Each task (EP, source, target): build the layout; from nothing, train one step (AdamW, the
    gradients synchronized as the trainer does), else load ``source``; save to ``target``."""
    for ep, source, target in tasks:
        model, optimizer, replicas = _built(ep, world_size)
        if source is None:
            tokens = torch.randint(VOCAB, (2, 17), generator=torch.Generator().manual_seed(rank))
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            synchronize_gradients(model, model.expert_parameter_names(), None if world_size == 1 else
                                  torch.distributed.group.WORLD, world_size, expert_replicas=replicas)
            optimizer.step()
        else:
            load_checkpoint(Path(source), model, optimizer, rank, world_size)
        save_checkpoint(Path(target), 1, model, optimizer, torch.distributed.group.WORLD, rank, world_size,
                        {"config": {}}, [], keep=1)
        barrier()  # rank 0 completes the checkpoint before anyone reads it


def _folder(root: Path, *layouts: tuple[int, int]) -> str:
    return str(root.joinpath(*(f"ep{ep}-dp{dp}" for ep, dp in layouts)))


def _checkpoint(run_dir: str) -> Path:
    return Path(run_dir) / "checkpoints" / "step-000001"


@pytest.mark.distributed
def test_a_checkpoint_saved_at_any_layout_loads_at_every_other(tmp_path: Path) -> None:
    by_workers: dict[int, list[tuple[int, int]]] = {}
    for ep, dp in LAYOUTS:
        by_workers.setdefault(ep * dp, []).append((ep, dp))
    for workers, layouts in by_workers.items():
        run_distributed(_save_and_reload, workers, [(ep, None, _folder(tmp_path, (ep, dp))) for ep, dp in layouts])
    for workers, layouts in by_workers.items():
        tasks = [(ep, str(_checkpoint(_folder(tmp_path, source))), _folder(tmp_path, source, (ep, dp)))
                 for source in LAYOUTS for ep, dp in layouts]
        run_distributed(_save_and_reload, workers, tasks)
    for source in LAYOUTS:
        saved = _checkpoint(_folder(tmp_path, source))
        keys = sorted(saved_keys(saved))
        assert any(".experts." in key and key.endswith("exp_avg_sq") for key in keys)
        expected = read_full_tensors(saved, keys)
        for target in LAYOUTS:
            again = _checkpoint(_folder(tmp_path, source, target))
            assert sorted(saved_keys(again)) == keys
            got = read_full_tensors(again, keys)
            for key in keys:
                assert torch.equal(got[key], expected[key]), f"saved at {source}, loaded at {target}: {key}"
