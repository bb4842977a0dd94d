"""expert_kernel="auto": the rates a probe measures, the share under which the ragged kernel wins,
and the choice a layer makes per call from them (recorded in last_stats, kept with the planner)."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.experts import expert_compute
from moeflow.parallel.kernel_probe import probe_kernel_rates
from moeflow.perf.kernel_rates import KernelRates


def test_the_fit_recovers_the_rates_and_the_share_where_ragged_wins() -> None:
    """Padded 3 s a slot; ragged 1 s a slot of the buffer plus 4 s a filled row: ragged wins under
    half the slots filled, and a probe's three times give these rates back."""
    slots, half = 1000, 480
    rates = KernelRates.from_times(slots, 3.0 * slots, 5.0 * slots, half, 1.0 * slots + 4.0 * half)
    assert rates.padded_s_per_slot == pytest.approx(3.0)
    assert rates.ragged_s_per_slot == pytest.approx(1.0)
    assert rates.ragged_s_per_row == pytest.approx(4.0)
    assert rates.ragged_below == pytest.approx(0.5)
    assert rates.kernel(499, 1000) == "ragged" and rates.kernel(500, 1000) == "bmm"
    assert rates.kernel(0, 0) == "bmm"  # nothing to compute: the padded path
    assert KernelRates.from_state(json.loads(json.dumps(rates.state_dict()))) == rates


def test_a_ragged_kernel_slower_everywhere_is_never_chosen() -> None:
    rates = KernelRates.from_times(100, 1.0, 3.0, 50, 2.5)  # ragged costs more a slot than padded, rows aside
    assert rates.ragged_below == 0.0 and rates.kernel(1, 100) == "bmm"
    flat = KernelRates.from_times(100, 1.0, 0.5, 50, 0.6)  # noise made half fill slower: no negative rate
    assert flat.ragged_s_per_row == 0.0 and flat.kernel(99, 100) == "ragged"


def test_the_probe_times_the_layers_shapes_and_takes_the_agreed_times() -> None:
    like = MoELayer(16, 32, 4).experts.weights()
    agreed: list[list[float]] = []

    def slowest(values: list[float]) -> list[float]:
        agreed.append(list(values))
        return [10.0, 20.0, 15.0]  # what the slowest rank measured

    rates = probe_kernel_rates(expert_compute("gelu"), like, 2, 8, torch.float32, torch.device("cpu"), "torch", slowest)
    assert len(agreed) == 1 and all(seconds > 0 for seconds in agreed[0])
    assert rates == KernelRates.from_times(4 * 2 * 8, 10.0, 20.0, 4 * 2 * 4, 15.0)


@pytest.mark.parametrize("below, kernel", [(2.0, "ragged"), (0.0, "bmm")])
def test_the_layer_runs_the_kernel_the_rates_choose_and_reports_it(below: float, kernel: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, capacity_factor=0.0)
    assert layer.config.expert_kernel == "auto"  # the default
    layer.planner.kernel_rates = KernelRates(1.0, 0.0, 1.0 / below) if below else KernelRates(1.0, 1.0, 1.0)
    layer(torch.randn(24, 16, requires_grad=True)).sum().backward()
    assert layer.last_stats.plan.expert_kernel == kernel
    with torch.no_grad():
        layer(torch.randn(24, 16))  # no backward: no probe, and the rates stay
    assert layer.planner.state_dict()["kernel_rates"] == layer.planner.kernel_rates.state_dict()


def test_the_first_call_in_training_mode_probes_once() -> None:
    """Training mode, not grad mode, starts the probe: ``model.train()`` sets it alike on every rank,
    where a rank's grad mode may differ from the others' (the probe's times are agreed in a collective)."""
    layer = MoELayer(16, 32, 4, capacity_factor=0.0).eval()
    layer(torch.randn(24, 16, requires_grad=True)).sum().backward()
    assert layer.planner.kernel_rates is None and layer.last_stats.plan.expert_kernel == "bmm"
    layer.train()
    layer(torch.randn(24, 16, requires_grad=True)).sum().backward()
    rates = layer.planner.kernel_rates
    assert rates is not None and rates.padded_s_per_slot > 0
    layer(torch.randn(24, 16, requires_grad=True)).sum().backward()
    assert layer.planner.kernel_rates is rates
