"""Pipeline parallelism (issue 81): a MoETransformer in stages over the ``pp`` dimension of a mesh,
run by torch.distributed.pipelining's schedules, equals the one-process model trained on the same
micro-batches (losses and parameters after 3 AdamW steps, fp32, dropless, aux loss on)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from moeflow.models.transformer import MoETransformer, TransformerConfig
from moeflow.pipeline import StageSplit, pipeline_stages, schedule_named
from moeflow.pipeline.build import _check_mesh
from pool import run_distributed

STEPS, MICROBATCHES, BATCH = 3, 4, 8
ADAM_EPS = 1e-6  # Adam divides by sqrt(v) + eps: at the default 1e-8 a gradient of ~1e-10 (an expert element few
# tokens reach, the key bias's zero) turns its summation-order rounding into a 1e-5 step difference


def _config() -> TransformerConfig:
    return TransformerConfig.build(vocab_size=64, context=8, layers=4, heads=2, model_dim=16, hidden_dim=32,
                                   num_experts=4, top_k=2, capacity_factor=0.0, aux_loss_weight=0.01,
                                   expert_kernel="bmm")


def _batches(replicas: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's tokens: ``BATCH`` sequences for each of ``replicas`` expert-parallel ranks."""
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 64, (BATCH * replicas, 9), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference(replicas: int = 1) -> dict[str, Any]:
    """One process: each step's batch in the same micro-batches (of each of ``replicas`` ranks'
    batches), the mean of their losses (the language model's and the aux losses) backpropagated."""
    torch.manual_seed(0)
    model = MoETransformer(_config(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    losses = []
    for idx, targets in _batches(replicas):
        total = 0.0
        for replica in range(replicas):
            rows = slice(replica * BATCH, (replica + 1) * BATCH)
            for idx_mb, targets_mb in zip(idx[rows].chunk(MICROBATCHES), targets[rows].chunk(MICROBATCHES),
                                          strict=True):
                _, loss = model(idx_mb, targets_mb)
                (loss / (MICROBATCHES * replicas)).backward()
                total += float(loss.detach()) / (MICROBATCHES * replicas)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "parameters": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(rank: int, world_size: int, schedule: str, ep_size: int = 1) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size // ep_size, ep_size), mesh_dim_names=("pp", "ep"))
    model = MoETransformer(_config(), group=mesh.get_group("ep"), seed=0)
    pipeline = pipeline_stages(model, mesh, schedule=schedule, microbatches=MICROBATCHES, batch_size=BATCH)
    optimizer = torch.optim.AdamW(list(pipeline.parameters()), lr=1e-2, eps=ADAM_EPS)
    losses, replica = [], mesh.get_local_rank("ep")
    for idx, targets in _batches(ep_size):
        rows = slice(replica * BATCH, (replica + 1) * BATCH)
        losses.append(pipeline.step(idx[rows], targets[rows]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    held = {name: p.detach().clone() for name, p in pipeline.named_parameters()}
    if ep_size > 1:  # each rank's experts are its share: the whole ones are compared
        held = {name: p for name, p in held.items() if name not in model.expert_parameter_names()}
        for stage in pipeline.stages:  # a collective over each stage's expert group, in block order
            for index, block in stage.blocks.items():
                full = block.moe.full_state_dict() if block.moe is not None else {}
                held |= {f"blocks.{index}.ffn.{name}": value for name, value in full.items()
                         if name.startswith("experts.")}
    return {"losses": losses, "parameters": held, "stages": [stage.index for stage in pipeline.stages]}


def _compare(results: list[dict[str, Any]], expected: dict[str, Any], schedule: str, pp_size: int) -> None:
    held = sorted({index for result in results for index in result["stages"]})
    assert held == list(range(schedule_named(schedule).num_stages(pp_size)))
    seen = set()
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5,
                                   atol=1e-6)
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
    _compare(run_distributed(_pipelined, 4, schedule, 2, timeout_s=300), _reference(2), schedule, 2)


def test_the_split_is_even_or_as_given_and_refuses_what_cannot_run() -> None:
    assert [list(r) for r in StageSplit.of(5, 2).blocks] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in StageSplit.of(4, 2, [1, 3]).blocks] == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="at least one block"):
        StageSplit.of(3, 4)
    with pytest.raises(ValueError, match="4 blocks in all"):
        StageSplit.of(4, 2, [1, 2])
    with pytest.raises(ValueError, match="pp_schedule='zb' is unknown"):
        schedule_named("zb")
    with pytest.raises(ValueError, match=r"\('pp', 'ep'\)"):  # data parallelism inside a stage: not yet
        _check_mesh(SimpleNamespace(mesh_dim_names=("pp", "dp", "ep")))
