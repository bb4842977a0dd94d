"""Lina's expert packing: the packed placement, the packer's decision, and training that packs.
(That a packed layer equals the reference, outputs and gradients, before and after packing, is in
the equivalence table: the ``packed-*`` cases on 1, 2 and 4 processes.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.parallel import ExpertPlacement
from moeflow.parallel.placement import gather_full
from moeflow.training import TrainConfig
from moeflow.training.checkpoint import latest_checkpoint, read_state
from moeflow.training.launch import run_training
from moeflow.training.metrics import iterate_records
from moeflow.training.packing import ExpertPacker, MicroOpTimes, pack_layer, parse_packing
from pool import run_distributed
from test_training import TINY, _evaluate_checkpoint


def _experts_of(placement: ExpertPlacement) -> list[list[int]]:
    return placement.experts_per_rank()


def test_blocks_of_ranks_each_hold_every_expert() -> None:
    packed = ExpertPlacement.packed(8, 4, 2, hidden_dim=6)
    assert _experts_of(packed) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert packed.packed_group_size == 2 and packed.holders(5) == (1, 3)
    assert ExpertPlacement.packed(8, 4, 4, 6) == ExpertPlacement.expert_parallel(8, 4, 6)
    assert ExpertPlacement.packed(8, 4, 1, 6) == ExpertPlacement.replicated(8, 4, 6)
    assert ExpertPlacement.expert_parallel(8, 4, 6).packed_group_size == 4
    assert ExpertPlacement.hidden_sharded(2, 4, 6).packed_group_size is None
    with pytest.raises(ValueError, match="group_size to divide both"):
        ExpertPlacement.packed(8, 4, 3, 6)


def _pack_and_train(rank: int, world_size: int, experts_per_rank: int) -> dict[str, Any]:
    """Pack a layer with AdamW state, then take a step: the full weights and moments after it."""
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, top_k=2, capacity_factor=0.0, group=dist.group.WORLD, parallel="expert")
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for step in range(2):
        if step == 1:
            assert pack_layer(layer, experts_per_rank, optimizer) == (experts_per_rank != 4 // world_size)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        ((layer(x) ** 2).sum() + layer.aux_loss).backward()
        block = 4 // layer.experts_per_rank  # ranks that hold every expert once
        for name, parameter in layer.named_parameters():
            if not name.startswith("experts."):  # the gate: summed as a trainer does (it then divides)
                dist.all_reduce(parameter.grad)
            elif block < world_size:  # a packed expert's copies add up their blocks' tokens
                dist.all_reduce(parameter.grad, group=layer.groups.strided(block))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    moments = {name: optimizer.state[p]["exp_avg"] for name, p in layer.experts.named_parameters()}
    full = layer.full_state_dict()
    return {
        "weights": {n: t.numpy() for n, t in full.items()},
        "moments": {n: gather_full(m, layer.placement, n, layer.rank, dist.group.WORLD).numpy()
                    for n, m in moments.items()},
        "schedule": layer.schedule.name, "local": layer.experts_per_rank,
    }


@pytest.mark.distributed
def test_packing_moves_weights_and_moments_and_trains_as_expert_parallel() -> None:
    plain = run_distributed(_pack_and_train, 4, 1, timeout_s=180)
    for experts_per_rank, schedule in ((2, "packed"), (4, "packed")):
        packed = run_distributed(_pack_and_train, 4, experts_per_rank, timeout_s=180)
        assert {(r["schedule"], r["local"]) for r in packed} == {(schedule, experts_per_rank)}
        for part in ("weights", "moments"):
            for name, tensor in plain[0][part].items():
                np.testing.assert_allclose(packed[0][part][name], tensor, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_packer_doubles_while_experts_are_shorter_than_all_to_alls(monkeypatch: pytest.MonkeyPatch) -> None:
    class Layer:
        def __init__(self) -> None:
            self.config, self.world_size, self.experts_per_rank = type("C", (), {"num_experts": 8})(), 8, 1
            self.packed: list[int] = []

    def pack_layer(layer: Layer, experts_per_rank: int, optimizer: Any) -> bool:
        layer.packed.append(experts_per_rank)
        layer.experts_per_rank = experts_per_rank
        return True

    monkeypatch.setattr("moeflow.training.packing.pack_layer", pack_layer)

    class Model:
        groups = type("G", (), {"size": 1})()

        def __init__(self) -> None:
            self.layers = [Layer(), Layer()]

        def moe_layers(self) -> list[Layer]:
            return self.layers

    model, packer = Model(), ExpertPacker("auto", warmup=3, interval=2)
    decisions = []
    for step, (expert, alltoall) in enumerate([(1, 5)] * 5 + [(2, 3)] * 2 + [(4, 2)] * 4, start=1):
        packer.record(MicroOpTimes(expert * 1e-3, alltoall * 1e-3))
        decisions.append(packer.step(step, model, None))  # type: ignore[arg-type]
    assert [step for step, packed in enumerate(decisions, start=1) if packed] == [3, 5, 7]
    assert model.layers[0].packed == [2, 4, 8] and packer.experts_per_rank == 8
    assert not decisions[8] and packer.settled  # step 9: 16 experts per worker do not exist
    packer = ExpertPacker("auto", warmup=1, interval=1)
    packer.record(MicroOpTimes(5e-3, 1e-3))
    assert not packer.step(1, Model(), None) and packer.settled  # type: ignore[arg-type]
    packer.record(MicroOpTimes(1e-3, 5e-3))
    assert not packer.step(2, Model(), None)  # type: ignore[arg-type]  # settled: it stays


@pytest.mark.distributed
@pytest.mark.parametrize("grad_sync", ["after", "lina"])
def test_auto_packing_decides_once_after_the_warm_up_and_resumes_exactly(tmp_path: Path, grad_sync: str) -> None:
    from moeflow.cli import main

    # the decision at step 2 rests on measured times: either it doubles to every expert on both workers
    # (and can go no further), or it settles at expert parallelism; either way no later step decides
    # (under lina the packed experts' copies add up in micro-ops during the backward)
    settings = {**TINY, "steps": 5, "parallel": "expert", "expert_packing": "auto", "packing_warmup": 2,
                "packing_interval": 1, "grad_sync": grad_sync, "microop_mb": 0.002, "checkpoint_interval": 3}
    run_dir = tmp_path / "run"
    run_training(TrainConfig(**settings, run_dir=str(run_dir)), report=False)
    whole = list(iterate_records(run_dir))
    packed_at_2 = whole[1]["packing"]["packed"]
    per_worker = 4 if packed_at_2 else 2
    assert [r["packing"]["experts_per_worker"] for r in whole] == [2] + [per_worker] * 4
    assert [r["packing"]["packed"] for r in whole] == [False, packed_at_2, False, False, False]
    assert all(r["packing"]["expert_op_s"] > 0 for r in whole[:2])
    assert (whole[-1]["packing"]["alltoall_op_s"] is None) == packed_at_2  # all experts everywhere: no all-to-all
    assert {layer["schedule"] for layer in whole[-1]["moe"]} == {"packed" if packed_at_2 else "expert"}
    state = json.loads((run_dir / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["packer"] == {"experts_per_rank": per_worker if packed_at_2 else None, "settled": not packed_at_2}

    assert main(["train", "--resume", str(run_dir / "checkpoints" / "step-000003")]) == 0  # steps 4 and 5 again
    resumed = list(iterate_records(run_dir))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # bit for bit after the packing
    assert [r["packing"]["experts_per_worker"] for r in resumed] == [r["packing"]["experts_per_worker"] for r in whole]


@pytest.mark.distributed
def test_fixed_packing_resumes_bit_for_bit(tmp_path: Path) -> None:
    from moeflow.cli import main

    settings = {**TINY, "steps": 4, "parallel": "expert", "expert_packing": "4", "grad_sync": "lina",
                "microop_mb": 0.002}
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "whole")), report=False)
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "resumed"), stop_at=2), report=False)
    assert main(["train", "--resume", str(tmp_path / "resumed")]) == 0
    whole, resumed = list(iterate_records(tmp_path / "whole")), list(iterate_records(tmp_path / "resumed"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in whole]
    assert all(r["packing"]["experts_per_worker"] == 4 and r["comm_s"]["all_to_all_alone_ops"] == 0 for r in whole)


@pytest.mark.distributed
def test_a_packed_checkpoint_evaluates_and_trains_on_other_worker_counts(tmp_path: Path) -> None:
    run_dir = tmp_path / "packed"
    settings = {**TINY, "steps": 4, "workers": 4, "parallel": "expert", "eval_interval": 4, "checkpoint_interval": 4}
    run_training(TrainConfig(**settings, expert_packing="2", run_dir=str(run_dir)), report=False)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and read_state(checkpoint)["packer"]["experts_per_rank"] == 2
    recorded = list(iterate_records(run_dir))[-1]["val_loss"]
    assert run_distributed(_evaluate_checkpoint, 2, str(checkpoint))[0] == pytest.approx(recorded, rel=1e-5)
    # one worker cannot hold 4 experts as 2 per worker: the packer starts over from expert parallelism
    summary = run_training(TrainConfig(**{**settings, "workers": 1, "steps": 6}, expert_packing="auto",
                                       run_dir=str(run_dir)), checkpoint, report=False)
    records = list(iterate_records(run_dir))
    assert summary["workers"] == 1 and [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["packing"]["experts_per_worker"] == 4 and np.isfinite(records[-1]["loss"])


@pytest.mark.distributed
def test_fixed_packing_on_four_workers_trains_like_expert_parallelism(tmp_path: Path) -> None:
    settings = {**TINY, "steps": 4, "workers": 4, "parallel": "expert", "eval_interval": 4}
    run_training(TrainConfig(**settings, run_dir=str(tmp_path / "ep")), report=False)
    ep = list(iterate_records(tmp_path / "ep"))
    for grad_sync in ("after", "lina"):  # lina: the copies' micro-ops run during the backward
        run_dir = tmp_path / f"packed-{grad_sync}"
        run_training(TrainConfig(**settings, expert_packing="2", grad_sync=grad_sync, microop_mb=0.002,
                                 run_dir=str(run_dir)), report=False)
        packed = list(iterate_records(run_dir))
        np.testing.assert_allclose([r["loss"] for r in packed], [r["loss"] for r in ep], rtol=1e-5)
        np.testing.assert_allclose([r["grad_norm"] for r in packed], [r["grad_norm"] for r in ep], rtol=1e-4)
        assert all(r["packing"]["experts_per_worker"] == 2 for r in packed)


@pytest.mark.parametrize(("changes", "message"), [
    ({"expert_packing": "sometimes"}, "off, auto or a number"),
    ({"expert_packing": "3"}, "cannot pack 4 experts"),
    ({"expert_packing": "auto", "parallel": "replicated"}, "use parallel='expert'"),
    ({"expert_packing": "auto", "alltoall": "2dh"}, "turn off alltoall"),
    ({"expert_packing": "auto", "redundant_experts": 2, "parallel": "expert"}, "turn off redundant_experts"),
    ({"expert_packing": "4", "mp_size": 2, "parallel": "auto"}, "drop --mp-size, or use --expert-packing off"),
])
def test_bad_packing_settings_name_the_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**TINY, **changes})


def test_packing_values_parse() -> None:
    assert parse_packing("off") == "off" and parse_packing("auto") == "auto" and parse_packing("2") == 2
    with pytest.raises(ValueError, match=">= 1"):
        parse_packing("0")
