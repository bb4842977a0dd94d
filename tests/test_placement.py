"""ExpertPlacement: full state -> every rank's part -> full state is the identity for whole,
replicated and hidden-sharded placements, on plain tensors and through real layers on gloo ranks;
and the placement is the one source of which rank holds what."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer
from moeflow.parallel import ExpertPlacement, ExpertShard
from moeflow.reference import ReferenceMoE
from pool import run_distributed

E, M, H = 4, 3, 8


def _full_state(swiglu: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"w1": (E, M, H), "b1": (E, H), "w2": (E, H, M), "b2": (E, M)}
    if swiglu:
        shapes["w3"] = (E, M, H)
    return {kind: torch.randn(shape, generator=generator) for kind, shape in shapes.items()}


PLACEMENTS = {
    "expert-parallel": ExpertPlacement.expert_parallel(E, 2, H),
    "one-rank": ExpertPlacement.expert_parallel(E, 1, H),
    "replicated": ExpertPlacement.replicated(E, 3, H),
    "hidden-sharded": ExpertPlacement.hidden_sharded(E, 8, H),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
@pytest.mark.parametrize("swiglu", [False, True])
def test_full_state_round_trip_is_the_identity(name: str, swiglu: bool) -> None:
    placement = PLACEMENTS[name]
    for kind, full in _full_state(swiglu).items():
        parts = [placement.shard_tensor(kind, full, rank) for rank in range(placement.world_size)]
        assert torch.equal(placement.assemble_tensor(kind, parts), full), (name, kind)


CHUNKED = {
    **PLACEMENTS,
    "ep-esp": ExpertPlacement.expert_and_hidden_sharded(E, 2, 2, H),
    "packed": ExpertPlacement.packed(E, 4, 2, H),
    "eplb-slots": ExpertPlacement(E, H, ((ExpertShard(0, 0, H), ExpertShard(1, 0, H), ExpertShard(0, 0, H)),
                                         (ExpertShard(2, 0, H), ExpertShard(3, 0, H), ExpertShard(0, 0, H))),
                                  split_tokens=True),
}


@pytest.mark.parametrize("name", list(CHUNKED))
def test_primary_chunks_tile_the_full_tensor_once_and_all_chunks_are_the_ranks_part(name: str) -> None:
    """What a sharded checkpoint writes (every rank's primary chunks) covers each element of the
    full tensor exactly once with its value; what a rank reads (all its chunks) is its part."""
    placement = CHUNKED[name]
    for kind, full in _full_state(swiglu=True).items():
        written = torch.zeros_like(full)
        times = torch.zeros_like(full)
        for rank in range(placement.world_size):
            part = placement.shard_tensor(kind, full, rank)
            for offsets, view in placement.chunks(kind, part, rank, primary_only=True):
                region = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape, strict=True))
                written[region] += view
                times[region] += 1
            rebuilt = torch.zeros_like(part)
            for offsets, view in placement.chunks(kind, rebuilt, rank, primary_only=False):
                region = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape, strict=True))
                view.copy_(full[region])
            assert torch.equal(rebuilt, part), (name, kind, rank)
        assert torch.equal(times, torch.ones_like(full)) and torch.equal(written, full), (name, kind)
    if name in ("expert-parallel", "packed"):  # a rank's consecutive experts are one chunk
        part = placement.shard_tensor("w1", _full_state(False)["w1"], 1)
        assert [offsets for offsets, _ in placement.chunks("w1", part, 1, primary_only=False)] == [(2, 0, 0)]


def test_each_placement_answers_who_holds_what() -> None:
    ep = PLACEMENTS["expert-parallel"]
    assert [s.expert for s in ep.local(1)] == [2, 3] and ep.holders(2) == (1,) and ep.is_expert_parallel
    replicated = PLACEMENTS["replicated"]
    assert replicated.holders(0) == (0, 1, 2) and replicated.is_replicated and not replicated.is_expert_parallel
    assert replicated.is_primary(0, 1) and not replicated.is_primary(2, 1)
    sharded = PLACEMENTS["hidden-sharded"]
    assert sharded.local(3) == (ExpertShard(1, 4, 8),) and sharded.holders(1) == (2, 3)
    assert sharded.shard_tensor("w1", _full_state(False)["w1"], 3).shape == (1, M, H // 2)
    # only the first shard of an expert adds its output bias; every shard holds it
    assert sharded.local(2)[0].adds_output_bias and not sharded.local(3)[0].adds_output_bias


def test_bad_placements_and_states_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by the expert group size 3"):
        ExpertPlacement.expert_parallel(4, 3, H)
    with pytest.raises(ValueError, match="multiple of num_experts"):
        ExpertPlacement.hidden_sharded(4, 6, H)
    with pytest.raises(ValueError, match="placed on no rank"):
        ExpertPlacement(2, H, ((ExpertShard(0, 0, H),),))
    with pytest.raises(ValueError, match="a full state needs 4 experts"):
        PLACEMENTS["expert-parallel"].shard_tensor("w1", torch.zeros(2, M, H), 0)


def _layer_round_trip(rank: int, world: int, parallel: str, bias: bool) -> list[str]:
    """A full state loads into each rank's part and gathers back unchanged on every rank."""
    torch.manual_seed(1)
    reference = ReferenceMoE(M, H, E, activation="swiglu", bias=bias, num_shared_experts=1)
    layer = MoELayer(M, H, E, activation="swiglu", bias=bias, parallel=parallel, num_shared_experts=1,
                     alltoall="linear")
    full = reference.state_dict()
    layer.load_full_state_dict(full)
    expected_local = 4 if parallel == "replicated" else E // world
    failures = [] if layer.experts.w1.shape[0] == expected_local else [f"local experts {layer.experts.w1.shape}"]
    gathered = layer.full_state_dict()
    if sorted(gathered) != sorted(full):
        failures.append(f"names {sorted(gathered)} != {sorted(full)}")
    failures += [f"rank {rank}: {name} differs" for name in full if not torch.equal(gathered[name], full[name])]
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize(("parallel", "bias"), [("expert", True), ("replicated", True), ("expert", False)])
def test_layer_full_state_round_trip_on_two_ranks(parallel: str, bias: bool) -> None:
    results = run_distributed(_layer_round_trip, 2, parallel, bias, timeout_s=120)
    assert results == [[], []]


def test_bias_free_experts_have_no_bias_entries() -> None:
    names = set(MoELayer(M, H, E, bias=False, activation="swiglu").state_dict())
    assert {"experts.w1", "experts.w2", "experts.w3"} <= names
    assert not {n for n in names if n.endswith((".b1", ".b2", ".b3"))}


def test_only_placements_without_hidden_slices_hold_whole_experts() -> None:
    assert ExpertPlacement.expert_parallel(4, 2, 16).holds_whole_experts
    assert ExpertPlacement.replicated(4, 2, 16).holds_whole_experts
    assert ExpertPlacement.packed(4, 4, 2, 16).holds_whole_experts
    assert not ExpertPlacement.hidden_sharded(2, 4, 16).holds_whole_experts
    assert not ExpertPlacement.expert_and_hidden_sharded(4, 2, 2, 16).holds_whole_experts
