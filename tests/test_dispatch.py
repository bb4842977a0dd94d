"""Fast encode/decode against their dense (one-hot) definition, with gradients."""

from __future__ import annotations

import torch

from moeflow.core.routing import assign_slots
from moeflow.kernels.slot_gather import decode, encode, make_slot_map


def _plan(tokens: int, experts: int, k: int, capacity: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)]
    expert_idx = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)
    location, _ = assign_slots(expert_idx, experts)
    return expert_idx, location, make_slot_map(expert_idx, location, experts, capacity)


def test_encode_decode_equal_the_dense_one_hot_form() -> None:
    tokens, experts, k, capacity, dim = 20, 4, 2, 7, 5  # capacity < 2*20/4: some drops
    expert_idx, location, plan = _plan(tokens, experts, k, capacity)
    x = torch.randn(tokens, dim, dtype=torch.float64)
    weights = torch.rand(tokens, k, dtype=torch.float64)
    dispatch_mask = torch.zeros(tokens, experts, capacity, dtype=torch.float64)  # the dense (T, E, C)
    combine = torch.zeros(tokens, experts, capacity, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            if location[t, j] < capacity:
                dispatch_mask[t, expert_idx[t, j], location[t, j]] = 1
                combine[t, expert_idx[t, j], location[t, j]] = weights[t, j]
    buffer = encode(x, plan)
    torch.testing.assert_close(buffer, torch.einsum("tec,tm->ecm", dispatch_mask, x))
    expert_out = torch.randn_like(buffer)
    torch.testing.assert_close(decode(expert_out, weights, plan), torch.einsum("tec,ecm->tm", combine, expert_out))


def test_encode_decode_gradients_pass_gradcheck() -> None:
    _, _, plan = _plan(tokens=9, experts=3, k=2, capacity=4, seed=3)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    buffer = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: encode(x, plan), (x,))
    assert torch.autograd.gradcheck(lambda b, w: decode(b, w, plan), (buffer, weights))


def test_dropped_choices_get_no_gradient_and_empty_batches_work() -> None:
    _, location, plan = _plan(tokens=12, experts=2, k=2, capacity=3)
    weights = torch.rand(12, 2, requires_grad=True)
    decode(torch.randn(2, 3, 4), weights, plan).sum().backward()
    assert (weights.grad[location >= 3] == 0).all()
    assert (weights.grad[location < 3] != 0).all()
    _, _, empty = _plan(tokens=0, experts=2, k=1, capacity=2)
    x = torch.randn(0, 4, requires_grad=True)
    y = decode(encode(x, empty) * 2, torch.ones(0, 1), empty)
    y.sum().backward()
    assert y.shape == (0, 4) and x.grad.shape == (0, 4)


def test_no_dense_dispatch_tensor_is_built() -> None:
    """Memory stays O(T*k*M): a (T, E, C) tensor here would need 8192*512*... bytes."""
    tokens, experts, k, capacity, dim = 8192, 512, 2, 32, 8
    _, _, plan = _plan(tokens, experts, k, capacity)
    largest = 0

    def record(t: torch.Tensor) -> None:
        nonlocal largest
        largest = max(largest, t.numel())

    x = torch.randn(tokens, dim, requires_grad=True)
    buffer = encode(x, plan)
    y = decode(buffer, torch.rand(tokens, k), plan)
    y.sum().backward()
    for t in (buffer, y, x.grad, *vars(plan).values()):
        if isinstance(t, torch.Tensor):
            record(t)
    assert largest <= experts * capacity * dim  # the (E, C, M) buffer, never T*E*C
