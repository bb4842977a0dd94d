"""``moeflow bench memory``'s layout scenarios: a user's own training loop on a (dp, ep) mesh.

W workers are laid out as EP = W / 2 expert-parallel ranks times DP = 2 data-parallel replicas
(one worker: neither), in processes whose allocator is as a user's own (not tuned by
:func:`moeflow.runtime.tune_cpu_allocator`, which keeps freed memory). A stack of MoE blocks (an
input projection, ``layers`` residual MoE layers, an output projection; one workspace for the
layers, as the layer guide asks) trains ``steps`` AdamW steps on random tokens, wrapped by
:func:`moeflow.training.data_parallel.expert_fully_shard` on the mesh:

- ``sharded-experts``: the experts FSDP2-sharded over their ``"dp"`` replicas (torchtitan's layout);
- ``whole-experts``: the same with every expert whole on its ``"ep"`` rank (the reference: what
  sharding saves).

The share (what a worker must hold) is the same for both: 16 bytes per non-expert parameter, 16
bytes per expert parameter over EP x DP (the fp32 weight, its gradient, AdamW's two moments), plus
the activations one step's forward keeps for the backward. ``sharded-experts`` carries the target
(every worker's ratio at most 1.5 at 2 workers and more); ``whole-experts`` is reported beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeflow.bench.memory_accounting import (
    TRAINING_BYTES_PER_PARAMETER,
    Measured,
    MemoryBenchConfig,
    held_parameters,
    saved_bytes,
    union_of,
    worker_peaks,
    worker_record,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


LAYOUT_SCENARIOS = ("sharded-experts", "whole-experts")
REFERENCE_SCENARIOS = ("whole-experts",)
"""Scenarios reported beside a target, not held to it."""
LOOP_TOKENS = 256
"""Tokens per worker per step (each worker its own micro-batch)."""


def mesh_shape(workers: int) -> tuple[int, int]:
    """(DP, EP) of ``workers``: two data-parallel replicas of an expert group of the rest."""
    return (1, 1) if workers == 1 else (2, workers // 2)


def check_layout(workers: int, num_experts: int) -> None:
    """Refuse a worker count this layout cannot take, naming the flags."""
    dp, ep = mesh_shape(workers)
    if dp * ep != workers or num_experts % ep:
        raise ValueError(f"--workers {workers}: the layout scenarios run EP = workers / 2 x DP = 2, so --workers "
                         f"must be 1 or even, and --num-experts {num_experts} divisible by EP {ep}")


def _stack(config: MemoryBenchConfig, group: Any) -> nn.Module:
    """The stacked MoE model, seeded alike on every worker (FSDP2 shards each rank's own copy)."""
    import torch
    from torch import nn

    from moeflow import MoELayer
    from moeflow.core.workspace import share_workspace

    class StackedMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            m = config.model_dim
            self.inp, self.out = nn.Linear(m, m), nn.Linear(m, m)
            self.blocks = nn.ModuleList(
                MoELayer(m, config.hidden_dim, config.num_experts, top_k=config.top_k, capacity_factor=0.0,
                         aux_loss_weight=0.0, group=group) for _ in range(config.layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            return self.out(h)

    torch.manual_seed(0)
    model = StackedMoE()
    share_workspace(model.blocks)  # as the layer guide asks of a model with layers of its own
    return model


def _train(model: nn.Module, config: MemoryBenchConfig, rank: int) -> None:
    import torch

    from moeflow.training.data_parallel import clip_grad_norm_

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)
    for _ in range(config.steps):
        loss = model(torch.randn(LOOP_TOKENS, config.model_dim, generator=data)).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm_(model, 1.0)
        optimizer.step()


def _layout_worker(rank: int, world_size: int, config: MemoryBenchConfig, scenario: str) -> dict[str, Any]:
    """The loop, then this process's peak; then the share, counted on a new unwrapped model."""
    import torch

    from moeflow.training.data_parallel import expert_fully_shard

    mesh = _mesh(world_size)
    group = None if mesh is None else mesh["ep"].get_group()
    model = _stack(config, group)
    if mesh is not None:
        expert_fully_shard(model, mesh=mesh, shard_experts=scenario == "sharded-experts")
    _train(model, config, rank)
    result = worker_peaks()
    del model
    plain = _stack(config, group)
    tokens = torch.randn(LOOP_TOKENS, config.model_dim, generator=torch.Generator().manual_seed(rank))
    result["held"] = held_parameters(plain)
    result["activation_bytes"] = saved_bytes(plain, lambda: plain(tokens))
    return result


def _mesh(world_size: int) -> DeviceMesh | None:
    from torch.distributed.device_mesh import init_device_mesh

    if world_size == 1:
        return None
    return init_device_mesh("cpu", mesh_shape(world_size), mesh_dim_names=("dp", "ep"))


def measure_layout(config: MemoryBenchConfig, scenario: str, workers: int, baseline: int) -> Measured:
    """One record per worker of the loop on ``workers`` gloo workers laid out (DP, EP)."""
    from moeflow.distributed import run_distributed

    dp, ep = mesh_shape(workers)
    # a user's own loop: glibc's allocator as their process has it (moeflow's tuning keeps freed memory)
    results = run_distributed(_layout_worker, workers, config, scenario, timeout_s=3600.0, tune_allocator=False)
    records = []
    for rank, result in enumerate(results):
        held = result["held"]
        element = 4  # fp32 parameters
        state = TRAINING_BYTES_PER_PARAMETER * (held.non_expert_bytes + held.expert_bytes // dp) // element
        activations = result["activation_bytes"]
        records.append(worker_record(scenario, workers, rank, result, baseline, state + activations, held, dp=dp,
                                     ep=ep, state_bytes=state, activation_bytes=activations, steps=config.steps,
                                     tokens_per_worker=LOOP_TOKENS))
    return records, union_of(result["modules"] for result in results)
