"""Pipeline parallelism (issue 81): a MoETransformer in stages over the ``pp`` dimension of a mesh,
run by torch.distributed.pipelining's schedules, equals the one-process model trained on the same
micro-batches (losses and parameters after 3 AdamW steps, fp32, dropless, aux loss on)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from moeflow.models.transformer import MoETransformer, TransformerConfig
from moeflow.pipeline import StageSplit, pipeline_stages, schedule_named
from pool import run_distributed

STEPS, MICROBATCHES, BATCH = 3, 4, 8


def _config() -> TransformerConfig:
    return TransformerConfig.build(vocab_size=64, context=8, layers=4, heads=2, model_dim=16, hidden_dim=32,
                                   num_experts=4, top_k=2, capacity_factor=0.0, aux_loss_weight=0.01,
                                   expert_kernel="bmm")


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 64, (BATCH, 9), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference() -> dict[str, Any]:
    """One process: each step's batch in the same micro-batches, the mean of their losses (the
    language model's and the aux losses) backpropagated."""
    torch.manual_seed(0)
    model = MoETransformer(_config(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for idx, targets in _batches():
        total = 0.0
        for idx_mb, targets_mb in zip(idx.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True):
            _, loss = model(idx_mb, targets_mb)
            (loss / MICROBATCHES).backward()
            total += float(loss.detach()) / MICROBATCHES
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "parameters": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pp", "ep"))
    model = MoETransformer(_config(), group=mesh.get_group("ep"), seed=0)
    pipeline = pipeline_stages(model, mesh, schedule=schedule, microbatches=MICROBATCHES, batch_size=BATCH)
    optimizer = torch.optim.AdamW(list(pipeline.parameters()), lr=1e-2)
    losses = []
    for idx, targets in _batches():
        losses.append(pipeline.step(idx, targets))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    held = {name: p.detach().clone() for stage in pipeline.stages for name, p in stage.named_parameters()}
    return {"losses": losses, "parameters": held, "stages": [stage.index for stage in pipeline.stages]}


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"])
def test_two_stages_equal_the_one_process_model(schedule: str) -> None:
    expected = _reference()
    results = run_distributed(_pipelined, 2, schedule, timeout_s=300)
    held = sorted(index for result in results for index in result["stages"])
    assert held == list(range(schedule_named(schedule).num_stages(2)))
    seen = set()
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5,
                                   atol=1e-6)
        for name, value in result["parameters"].items():
            torch.testing.assert_close(value, expected["parameters"][name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")  # Adam lifts the key bias's
            # zero gradient's rounding noise to about 2e-6
            seen.add(name)
    assert seen == set(expected["parameters"])  # every parameter is held by some stage


def test_the_split_is_even_or_as_given_and_refuses_what_cannot_run() -> None:
    assert [list(r) for r in StageSplit.of(5, 2).blocks] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in StageSplit.of(4, 2, [1, 3]).blocks] == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="at least one block"):
        StageSplit.of(3, 4)
    with pytest.raises(ValueError, match="4 blocks in all"):
        StageSplit.of(4, 2, [1, 2])
    with pytest.raises(ValueError, match="pp_schedule='zb' is unknown"):
        schedule_named("zb")
