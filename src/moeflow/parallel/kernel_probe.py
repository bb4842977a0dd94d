"""Times the padded and the ragged expert kernel on a layer's own shapes, once per layer, for
``expert_kernel="auto"`` (:mod:`moeflow.perf.kernel_rates` says what the times decide).

The probe runs the experts' compute (forward, input gradient, weight gradients) on a buffer of the
layer's received shape with random weights of the experts' shapes: the times depend on the shapes
only, and fresh tensors leave the real weights, their gradients and any sharding alone. No
collective runs in a probe; the caller agrees the times over the group (the slowest rank's), so
every rank holds the same rates and a resumed run decides as the interrupted one would have.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from moeflow.core.experts import FFNCompute, FFNWeights
from moeflow.kernels.ragged import RaggedFFNCompute
from moeflow.perf.kernel_rates import KernelRates

PROBE_REPEATS = 3
"""Timed runs of each kernel (after one untimed run), interleaved; the median is kept."""


def probe_kernel_rates(
    compute: FFNCompute, like: FFNWeights, sources: int, capacity: int, dtype: torch.dtype, device: torch.device,
    backend: str, reduce_max: Callable[[Sequence[float]], list[float]] | None,
) -> KernelRates:
    """The rates of ``compute`` over ``like``'s experts receiving ``capacity`` slots from each of
    ``sources`` ranks: padded, ragged with every slot filled and ragged with half of each filled."""
    experts = like.w1.shape[0]
    model_dim = like.w1.shape[1]
    generator = torch.Generator(device).manual_seed(0)  # its own: the run's random stream stays untouched

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)

    weights = FFNWeights(*(None if w is None else draw(*w.shape) * 0.02 for w in like.as_tuple()))
    x = draw(experts, sources * capacity, model_dim)
    grad = draw(*x.shape)
    half = capacity // 2

    def ragged(filled: int) -> RaggedFFNCompute:
        return RaggedFFNCompute(compute, torch.full((experts, sources), filled, dtype=torch.long), backend=backend)

    kernels = (compute, ragged(capacity), ragged(half))
    samples: list[list[float]] = [[] for _ in kernels]
    for repeat in range(PROBE_REPEATS + 1):
        for kernel, times in zip(kernels, samples, strict=True):
            seconds = _run_seconds(kernel, x, grad, weights)
            if repeat:
                times.append(seconds)
    medians = [statistics.median(times) for times in samples]
    padded_s, full_s, half_s = medians if reduce_max is None else reduce_max(medians)
    slots = experts * sources * capacity
    return KernelRates.from_times(slots, padded_s, full_s, experts * sources * half, half_s)


def _run_seconds(compute: FFNCompute | RaggedFFNCompute, x: torch.Tensor, grad: torch.Tensor,
                 weights: FFNWeights) -> float:
    """One forward, input gradient and weight gradients of ``compute``: its wall time (the device's)."""
    with torch.no_grad():
        _synchronize(x.device)
        start = time.perf_counter()
        _, saved = compute.forward(x, weights)
        _, inputs = compute.backward_input(saved, grad, weights)
        compute.weight_grads(inputs, weights)
        _synchronize(x.device)
        return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
