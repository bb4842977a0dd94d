"""The layer in a user's own training loop (issue 41): a loop built with moeflow's data-parallel
helpers on W gloo processes trains the model one process trains with every expert, step by step
(losses and the clipped global gradient norm, fp32, tight tolerance), with DDP and with FSDP2;
a plain DDP around expert-parallel experts is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from moeflow import MoELayer
from moeflow.training.data_parallel import (
    clip_grad_norm_,
    expert_data_parallel,
    expert_fully_shard,
    expert_parameter_names,
)
from pool import run_distributed

M, H, ROWS, STEPS, MAX_NORM = 8, 16, 32, 4, 0.3


class Net(nn.Module):
    """What a user writes: a projection, an MoE feed-forward block with a residual, a head."""

    def __init__(self, parallel: str, num_experts: int, world_size: int, group: Any = None) -> None:
        super().__init__()
        self.inp = nn.Linear(M, M)
        self.moe = MoELayer(M, H, num_experts, top_k=2, capacity_factor=0.0, aux_loss_weight=0.0,
                            parallel=parallel, group=group or (dist.group.WORLD if world_size > 1 else None))
        self.out = nn.Linear(M, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _loop(
    rank: int, world_size: int, wrap: str, parallel: str, num_experts: int, autocast: bool = False,
    ep_size: int | None = None, optimizer_name: str = "sgd",
) -> dict[str, list[float]]:
    """Seed alike, wrap, and train STEPS steps of SGD with global-norm clipping on this rank's
    share of one global batch (under bf16 autocast if asked); return the mean loss over the ranks
    and the norm, per step. ``ep_size``: the experts over ``ep_size`` ranks of a (dp, ep) mesh,
    replicated over its ``world_size / ep_size`` data-parallel rows."""
    mesh = None
    if ep_size is not None:
        mesh = init_device_mesh("cpu", (world_size // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    model = Net(parallel, num_experts, world_size, None if mesh is None else mesh["ep"].get_group())
    trained: nn.Module = model
    if wrap == "ddp":
        trained = expert_data_parallel(model, mesh=mesh)
    elif wrap.startswith("fsdp2"):  # on a (dp, ep) mesh "fsdp2" shards the experts too, "fsdp2-whole" does not
        trained = expert_fully_shard(model, mesh=mesh, shard_experts=wrap == "fsdp2")
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        x, y = torch.randn(ROWS, M, generator=data), torch.randn(ROWS, 1, generator=data)
        share = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = trained(x[share])
        loss = F.mse_loss(out.float(), y[share])
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(clip_grad_norm_(model, MAX_NORM)))
        optimizer.step()
        mean = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    w1 = model.moe.experts.w1
    held = w1.to_local().numel() if isinstance(w1, DTensor) else w1.numel()
    return {"losses": losses, "norms": norms, "expert_w1_share": [held / (num_experts * M * H)]}


def _loops(rank: int, world_size: int, cases: list[tuple[Any, ...]]) -> list[dict[str, list[float]]]:
    return [_loop(rank, world_size, *case) for case in cases]


CASES = {
    2: [("ddp", "expert", 4), ("ddp", "replicated", 4), ("fsdp2", "expert", 4),
        ("ddp", "expert", 4, True)],  # mixed precision: bf16 autocast, the norm in fp32
    4: [("ddp", "expert", 4), ("fsdp2", "expert", 8), ("ddp", "adaptive", 2),  # adaptive E=2: hidden shards
        ("ddp", "expert", 4, False, 2), ("fsdp2", "expert", 8, False, 2),  # EP 2 x DP 2 on a (dp, ep) mesh
        ("fsdp2", "expert", 8, False, 2, "adamw"), ("fsdp2-whole", "expert", 8, False, 2, "adamw"),
        ("ddp", "expert", 8, False, 2, "adamw"),
        ("fsdp2", "adaptive", 2, False, 2),  # the experts sharded over "dp": every expert, hidden shards
        ("ddp", "replicated", 4, False, 2)],
}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_user_loop_with_the_helpers_trains_the_one_process_model(world_size: int) -> None:
    cases = CASES[world_size]
    results = run_distributed(_loops, world_size, cases, timeout_s=300)
    for index, case in enumerate(cases):
        expected = _loop(0, 1, "none", "expert", *case[2:4], optimizer_name=case[5] if len(case) > 5 else "sgd")
        assert max(expected["norms"]) > MAX_NORM, "the clipping must bind for the norm to matter"
        tolerance = {"rtol": 2e-2, "atol": 1e-3} if any(case[3:4]) else {"rtol": 1e-5, "atol": 1e-6}  # bf16 or fp32
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            torch.testing.assert_close(got["losses"], expected["losses"], **tolerance,
                                       msg=f"{case} W={world_size} rank {rank} losses")
            torch.testing.assert_close(got["norms"], expected["norms"], **tolerance,
                                       msg=f"{case} W={world_size} rank {rank} norms")
            sharded = case[0] == "fsdp2" and len(case) > 4  # the experts over "dp" as well as "ep"
            expert_ranks = 1 if case[1] == "replicated" else world_size if sharded or len(case) < 5 else case[4]
            assert got["expert_w1_share"] == [1 / expert_ranks], f"{case} rank {rank}: {got['expert_w1_share']} of w1"


def test_one_process_norm_is_torchs_and_experts_are_marked() -> None:
    torch.manual_seed(0)
    model = Net("expert", 4, 1)
    F.mse_loss(model(torch.randn(ROWS, M)), torch.randn(ROWS, 1)).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(clip_grad_norm_(model, 1e9), expected, rtol=1e-6, atol=0)
    assert expert_parameter_names(model) == [f"moe.experts.{n}" for n, _ in model.moe.experts.named_parameters()]
    assert all(p.skip_allreduce and not p.allreduce for p in model.moe.experts.parameters())
    assert not any(getattr(p, "skip_allreduce", False) for p in model.moe.gate.parameters())


def _plain_ddp(rank: int, world_size: int, parallel: str) -> str:
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(parallel, 4, world_size))
    try:
        model(torch.randn(4, M)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "ran"


def _ddp_on_the_expert_group(rank: int, world_size: int) -> str:
    try:
        expert_data_parallel(Net("expert", 4, world_size), process_group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.distributed
def test_plain_ddp_around_expert_parallel_experts_is_refused() -> None:
    refused = run_distributed(_plain_ddp, 2, "expert", timeout_s=120)
    assert all("expert_data_parallel" in message and "E/W distinct experts" in message for message in refused)
    assert run_distributed(_plain_ddp, 2, "replicated", timeout_s=120) == ["ran", "ran"]  # replicas may average
    shared = run_distributed(_ddp_on_the_expert_group, 2, timeout_s=120)  # its all-reduces would meet the all-to-alls
    assert all("a group of its own" in message for message in shared)


def test_a_nonfinite_norm_is_returned_and_leaves_the_gradients_alone() -> None:
    torch.manual_seed(0)
    model = Net("expert", 4, 1)
    F.mse_loss(model(torch.randn(ROWS, M)), torch.randn(ROWS, 1)).backward()
    model.out.weight.grad[0, 0] = float("inf")  # an fp16 overflow: the step is to be skipped, not zeroed
    before = [p.grad.clone() for p in model.parameters()]
    assert clip_grad_norm_(model, 0.1).isinf()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def _shard_refusals(rank: int, world_size: int) -> list[str]:
    """FSDP2 on experts with copies (replicated) is refused; so is moving sharded experts."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    messages = []
    try:
        expert_fully_shard(Net("replicated", 4, world_size, mesh["ep"].get_group()), mesh=mesh)
    except ValueError as error:
        messages.append(str(error))
    try:
        shadowing = MoELayer(M, H, 4, top_k=2, shadowing=[0], group=mesh["ep"].get_group())
        expert_fully_shard(nn.Sequential(shadowing), mesh=mesh)
    except ValueError as error:
        messages.append(str(error))
    model = Net("expert", 4, world_size, mesh["ep"].get_group())
    expert_fully_shard(model, mesh=mesh)
    try:
        model.moe.switch(model.moe.schedule, _other(model.moe))
    except ValueError as error:
        messages.append(str(error))
    from moeflow.training.mesh_checkpoint import save_mesh_checkpoint

    for optimizer, given in ((torch.optim.SGD(model.parameters(), lr=0.1), mesh), (None, None)):
        try:  # SGD's state is not Adam's; without the mesh, the expert group is not the whole world
            save_mesh_checkpoint("/nonexistent", model, optimizer, given)
        except ValueError as error:
            messages.append(str(error))
    return messages


def _other(layer: MoELayer) -> Any:
    """Another placement of the layer's experts: the experts of the two ranks swapped."""
    import dataclasses

    return dataclasses.replace(layer.placement, shards=tuple(reversed(layer.placement.shards)))


@pytest.mark.distributed
def test_sharded_experts_refuse_copies_shadows_and_moves_and_the_mesh_checkpoint_its_limits() -> None:
    for messages in run_distributed(_shard_refusals, 4, timeout_s=120):
        assert len(messages) == 5, messages
        assert "keeps copies of its experts" in messages[0] and "shard_experts=False" in messages[0]
        assert "shadows experts" in messages[1] and "shard_experts=False" in messages[1]
        assert "sharded (FSDP2" in messages[2] and "shard_experts=False" in messages[2]
        assert "not SGD's" in messages[3] and "optimizer=None" in messages[3]
        assert 'is not this rank\'s mesh "ep" group' in messages[4]



def _resumed_losses(rank: int, world_size: int, wrap: str, ep_size: int, path: str, save: bool) -> list[float]:
    """Train 2 steps of AdamW (the 8-expert Net, EP = ep_size over a (dp, ep) mesh), save with
    save_mesh_checkpoint and train 2 more; or load such a checkpoint and train those 2 steps.
    Returns the losses after the checkpoint (mean over the ranks)."""
    from moeflow.training.mesh_checkpoint import load_mesh_checkpoint, save_mesh_checkpoint

    mesh = None
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size // ep_size, ep_size), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0 if save else 1)  # the loading run starts elsewhere: the checkpoint must carry it all
    model = Net("expert", 8, world_size, None if mesh is None else mesh["ep"].get_group())
    trained: nn.Module = model
    if wrap == "ddp":
        trained = expert_data_parallel(model, mesh=mesh)
    elif wrap.startswith("fsdp2"):
        trained = expert_fully_shard(model, mesh=mesh, shard_experts=wrap == "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(ROWS, M, generator=data), torch.randn(ROWS, 1, generator=data)) for _ in range(4)]
    if not save:
        load_mesh_checkpoint(path, trained, optimizer, mesh)
    losses = []
    for step, (x, y) in enumerate(batches if save else batches[2:]):
        if save and step == 2:
            save_mesh_checkpoint(path, trained, optimizer, mesh)
        share = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
        loss = F.mse_loss(trained(x[share]), y[share])
        optimizer.zero_grad()
        loss.backward()
        clip_grad_norm_(model, MAX_NORM)
        optimizer.step()
        mean = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    return losses[-2:]


def _saved_and_resumed(rank: int, world_size: int, path: str) -> list[list[float]]:
    """Saved at EP 2 x DP 2 (sharded experts), then resumed over EP 4 (DDP) and over EP 1 x DP 4
    (sharded experts), in one job (each run on meshes of its own)."""
    return [_resumed_losses(rank, world_size, "fsdp2", 2, path, True),
            _resumed_losses(rank, world_size, "ddp", 4, path, False),
            _resumed_losses(rank, world_size, "fsdp2", 1, path, False)]


@pytest.mark.distributed
def test_a_mesh_checkpoint_resumes_on_another_layout(tmp_path: Any) -> None:
    """Saved at EP 2 x DP 2 with the experts FSDP2-sharded, AdamW's state included: resumed with
    the experts whole over EP 4 (DDP), over EP 1 x DP 4 (FSDP2-sharded), and on one process, the
    next steps' losses are the uninterrupted run's."""
    path = str(tmp_path / "mesh")
    expected, *resumed = run_distributed(_saved_and_resumed, 4, path, timeout_s=120)[0]
    resumed.append(run_distributed(_resumed_losses, 1, "none", 1, path, False, timeout_s=120)[0])
    for layout, got in zip(("DDP over EP 4", "sharded over EP 1 x DP 4", "one process"), resumed, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=layout)
