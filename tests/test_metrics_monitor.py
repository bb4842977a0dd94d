"""The MoE monitor: each figure equals the one computed from the layers' own statistics (one
process, and over 2 and 4 gloo processes, where the figures are every rank's tokens), gradient
accumulation and recompute counted as the forwards that ran, and the alerts (each fires on a run
built to trip it, once, and stays silent on a balanced one)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from moeflow import MoEConfig, MoELayer
from moeflow.comm.groups import ParallelGroups
from moeflow.metrics import HealthRules, MoEMonitor, StepHealth
from moeflow.metrics.alerts import ALLTOALL, COLLAPSED, DEAD_EXPERT, DROPS
from moeflow.metrics.monitor import MoEHealthWarning
from pool import run_distributed

TOLERANCE = 1e-6  # fp32 entropies summed over 64 tokens


def _layer(world_size: int = 1, group: object = None, **settings: object) -> MoELayer:
    torch.manual_seed(0)
    config = MoEConfig(model_dim=16, hidden_dim=32, num_experts=4 * world_size,
                       **{"top_k": 2, "capacity_factor": 1.0, **settings})
    return MoELayer(config, group=group)


def _entropy_mean(logits_TE: torch.Tensor) -> float:
    probs = torch.softmax(logits_TE.detach().float(), dim=-1)
    return float(-(probs * probs.log()).sum(-1).mean())


def test_each_figure_equals_the_layers_own_statistics() -> None:
    layer = _layer(expert_bias_update_rate=0.05)
    monitor, moved = MoEMonitor(layer), []
    for _ in range(3):
        x = torch.randn(64, 16, requires_grad=True)
        layer(x).sum().backward()
        stats, logits = layer.last_stats, layer.gate(x)
        health = monitor.step().layers[0]
        load = np.array(stats.tokens_per_expert, dtype=float)
        assert health.tokens_per_expert == stats.tokens_per_expert
        assert health.load_max_over_mean == pytest.approx(load.max() / load.mean())
        assert health.load_cv == pytest.approx(load.std() / load.mean())
        assert health.busiest_share == pytest.approx(load.max() / load.sum())
        assert health.dropped == stats.dropped > 0  # capacity factor 1 on an unbalanced router drops some
        assert health.dropped_share == pytest.approx(stats.dropped / load.sum())
        assert health.router_entropy == pytest.approx(_entropy_mean(logits), abs=TOLERANCE)
        bias = layer.gate.expert_bias
        assert (health.bias_min, health.bias_max) == (float(bias.min()), float(bias.max()))
        moved.append(health.bias_max > health.bias_min)
        plan = stats.plan
        assert (health.schedule, health.pipeline_degree, health.alltoall, health.token_exchange) == (
            plan.schedule, plan.pipeline_degree, plan.alltoall, plan.token_exchange)
        assert health.bytes_sent == 0 and health.alltoall_share == 0.0  # one process sends nothing
    assert any(moved)  # loss-free balancing moved the bias (two opposite moves may bring it back to 0)
    monitor.close()


def test_accumulated_forwards_add_up_and_a_recompute_does_not() -> None:
    layer = _layer()
    monitor = MoEMonitor(layer)
    counts, logits = np.zeros(4, dtype=int), []
    for _ in range(2):  # gradient accumulation: two forwards make the step
        x = torch.randn(32, 16, requires_grad=True)
        checkpoint(layer, x, use_reentrant=False).sum().backward()  # the backward reruns the forward
        counts += layer.last_stats.tokens_per_expert
        logits.append(layer.gate(x))
    health = monitor.step().layers[0]
    assert health.tokens_per_expert == counts.tolist()
    assert sum(health.tokens_per_expert) == 2 * 32 * 2  # 64 tokens, top-2: not counted again by the recompute
    assert health.router_entropy == pytest.approx(_entropy_mean(torch.cat(logits)), abs=TOLERANCE)


def test_discard_forgets_the_forwards_since_the_last_step() -> None:
    layer = _layer()
    monitor = MoEMonitor(layer)
    with torch.no_grad():
        layer(torch.randn(50, 16))  # an evaluation between two steps
    monitor.discard()
    layer(torch.randn(8, 16))
    assert sum(monitor.step().layers[0].tokens_per_expert) == 8 * 2


def _global_figures(rank: int, world_size: int, ep_size: int) -> dict[str, object]:
    """A user's loop: each rank its own tokens, the experts over groups of ``ep_size`` ranks."""
    groups = [dist.new_group(list(range(first, first + ep_size))) for first in range(0, world_size, ep_size)]
    layer = _layer(ep_size, ParallelGroups.from_group(groups[rank // ep_size]))
    monitor = MoEMonitor(layer, rules=HealthRules(warmup_steps=0))
    torch.manual_seed(100 + rank)
    x = torch.randn(24 + 8 * rank, 16, requires_grad=True)
    layer(x).sum().backward()
    logits = layer.gate(x).detach()
    health = monitor.step(step_s=1e-9).layers[0]  # a step built to be all all-to-all
    local_counts = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4 * ep_size)
    probs = torch.softmax(logits, dim=-1)
    return {"health": health, "local_counts": local_counts.tolist(), "tokens": x.shape[0],
            "entropy_sum": float(-(probs * probs.log()).sum()), "alerts": monitor.alerts.fired,
            "bytes": layer.groups.ledger.bytes_by_layer[layer.index]}


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "ep_size"), [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_figures_cover_every_ranks_tokens(world_size: int, ep_size: int) -> None:
    results = run_distributed(_global_figures, world_size, ep_size)
    health = results[0]["health"]
    assert all(result["health"] == health for result in results)  # one figure on every rank
    assert health.tokens_per_expert == np.sum([r["local_counts"] for r in results], axis=0).tolist()
    tokens = sum(r["tokens"] for r in results)
    assert health.router_entropy == pytest.approx(sum(r["entropy_sum"] for r in results) / tokens, abs=TOLERANCE)
    assert health.bytes_sent == sum(r["bytes"] for r in results) > 0
    assert health.alltoall_share > 0.5 and (ALLTOALL, None) in results[0]["alerts"]


def _run(layer: MoELayer, monitor: MoEMonitor, steps: int) -> list[StepHealth]:
    healths = []
    for _ in range(steps):
        layer(torch.randn(64, 16, requires_grad=True)).sum().backward()
        healths.append(monitor.step())
    return healths


def _fired(healths: list[StepHealth]) -> list[list[str]]:
    """The alerts that fired at each step."""
    return [[alert.kind for alert in health.alerts] for health in healths]


def test_a_collapsed_router_and_dead_experts_alert_once() -> None:
    layer = _layer(top_k=1, capacity_factor=0)
    layer.gate.expert_bias[0] = 100.0  # every token picks expert 0
    monitor = MoEMonitor(layer, rules=HealthRules(collapse_steps=3, dead_window=4))
    with pytest.warns(MoEHealthWarning) as caught:
        fired = _fired(_run(layer, monitor, 6))
    assert fired == [[], [], [COLLAPSED], [DEAD_EXPERT], [], []]
    assert len(caught) == 2 and "block 0's router collapsed: expert 0" in str(caught[0].message)
    assert "expert(s) [1, 2, 3] received no token for 4 steps" in str(caught[1].message)


def test_a_resumed_monitor_goes_on_where_the_interrupted_one_stopped() -> None:
    """Through its JSON state (a checkpoint's): the dead-expert window and the collapse streak go on,
    and an alert said before the interruption is not said again."""
    import json

    rules = HealthRules(collapse_steps=3, dead_window=4)
    layer = _layer(top_k=1, capacity_factor=0)
    layer.gate.expert_bias[0] = 100.0  # every token picks expert 0
    whole = MoEMonitor(layer, rules=rules)
    with pytest.warns(MoEHealthWarning):
        uninterrupted = _fired(_run(layer, whole, 6))
    whole.close()
    first = MoEMonitor(layer, rules=rules)
    with pytest.warns(MoEHealthWarning):  # the collapse, at step 3
        before = _fired(_run(layer, first, 3))
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = MoEMonitor(layer, rules=rules)
    resumed.load_state_dict(state)
    with pytest.warns(MoEHealthWarning) as caught:  # only the dead experts, at step 4
        after = _fired(_run(layer, resumed, 3))
    assert before + after == uninterrupted == [[], [], [COLLAPSED], [DEAD_EXPERT], [], []]
    assert len(caught) == 1 and "received no token for 4 steps" in str(caught[0].message)


def test_drops_over_the_set_share_alert() -> None:
    layer = _layer(capacity_factor=0.25)
    monitor = MoEMonitor(layer, rules=HealthRules(max_dropped_share=0.2))
    with pytest.warns(MoEHealthWarning, match="--capacity-factor"):
        fired = _fired(_run(layer, monitor, 2))
    assert fired == [[DROPS], []]


def test_a_balanced_router_is_silent() -> None:
    layer = _layer(capacity_factor=0)
    with torch.no_grad():
        layer.gate.weight.mul_(0.01)  # near-uniform scores: no expert dominates, none starves
    monitor = MoEMonitor(layer, rules=HealthRules(dead_window=3, collapse_steps=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MoEHealthWarning)
        healths = _run(layer, monitor, 5)
    assert _fired(healths) == [[]] * 5
    assert healths[-1].layers[0].router_entropy == pytest.approx(math.log(4), rel=1e-3)  # the uniform router's


def test_bad_rules_name_the_setting() -> None:
    with pytest.raises(ValueError, match="max_dropped_share must be in"):
        HealthRules(max_dropped_share=1.5)
    with pytest.raises(ValueError, match="MoEMonitor: the model holds no moeflow MoE block"):
        MoEMonitor(torch.nn.Linear(2, 2))


def test_bench_monitor_prints_pairs_and_the_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.bench.monitor import run
    from moeflow.training.config import TrainConfig

    tiny = TrainConfig(vocab_size=64, context=16, layers=2, heads=2, model_dim=16, hidden_dim=32, batch_size=2)
    summary = run(repeats=2, warmup=0, config=tiny)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and '"summary": "bench monitor"' in lines[-1]
    assert summary["observe_s"] > 0 and math.isfinite(summary["overhead"])
