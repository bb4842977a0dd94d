"""The simulator's pieces against closed forms: link sharing, a pipeline of d chunks, the ring
all-reduce, 2DH's message count, profile errors, and the simulate command."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from dataclasses import replace

import numpy as np
import pytest

from moeflow.config import LayerDims
from moeflow.perf.sim.cluster import cluster_from_toml
from moeflow.perf.sim.workload import model_from_toml
from moeflow.sim import (
    Cluster,
    ClusterFileError,
    Device,
    LayerLoad,
    Link,
    ModelSpec,
    Network,
    StepPlan,
    StepResult,
    Timeline,
    Transfer,
    fair_rates,
    load_cluster,
    named_clusters,
    plan_label,
    routing_loads,
    simulate_step,
)

GOOD_PROFILE = """
name = "toy"
[topology]
nodes = 2
gpus_per_node = 4
[device]
gemm_tflops = 100.0
kernel_overhead_us = 5.0
memory_bandwidth_gb_s = 1000.0
[intra_node]
bandwidth_gbit_s = 800.0
latency_us = 2.0
message_overhead_us = 1.0
[inter_node]
nic_bandwidth_gbit_s = 100.0
nics_per_node = 1
latency_us = 5.0
message_overhead_us = 3.0
"""


def dims(model_dim: int, hidden_dim: int, num_experts: int, top_k: int = 2) -> LayerDims:
    """A simulated layer's dims: no biases, as the simulator's models count an expert's weights."""
    return LayerDims(model_dim, hidden_dim, num_experts, top_k=top_k, bias=False)


def toy(nodes: int = 2, per_node: int = 4, gap: float = 0.0, latency: float = 0.0) -> Cluster:
    return Cluster("toy", nodes, per_node, Device("d", 1e14, 0.0, 1e12),
                   Link(100e9, latency, gap), Link(10e9, latency, gap))


def one_resource(seconds: float) -> Transfer:
    return Transfer(np.array([seconds, 0.0]), 0.0)


def test_two_messages_on_one_link_halve_each_others_rate() -> None:
    timeline = Timeline(world=1)
    first = timeline.transfer("a", one_resource(1.0))
    second = timeline.transfer("b", one_resource(1.0))
    short = timeline.transfer("c", Transfer(np.array([0.0, 1.0]), 0.0))  # another link: unaffected
    timeline.run()
    assert timeline.finish[first] == pytest.approx(2.0) and timeline.finish[second] == pytest.approx(2.0)
    assert timeline.finish[short] == pytest.approx(1.0)
    # unequal: the short one ends at 2 x 0.5, then the long one has the link to itself
    timeline = Timeline(world=1)
    long_, small = timeline.transfer("a", one_resource(1.0)), timeline.transfer("b", one_resource(0.5))
    timeline.run()
    assert timeline.finish[small] == pytest.approx(1.0) and timeline.finish[long_] == pytest.approx(1.5)


def test_priority_serves_the_alltoall_first_and_max_min_gives_leftovers() -> None:
    rates = fair_rates([np.array([1.0, 0.0]), np.array([1.0, 0.0])], [1, 0])
    assert rates[0] == pytest.approx(1.0) and rates[1] == pytest.approx(1e-12)
    # transfer 0 is capped by its own second resource at rate 0.25; transfer 1 takes what is left
    rates = fair_rates([np.array([1.0, 4.0]), np.array([1.0, 0.0])], [0, 0])
    assert rates == pytest.approx([0.25, 0.75])


@pytest.mark.parametrize("degree", [1, 2, 4, 8])
@pytest.mark.parametrize(("comm", "compute"), [(1.0, 0.5), (1.0, 3.0), (2.0, 2.0)])
def test_pipeline_of_equal_chunks_matches_the_closed_form(degree: int, comm: float, compute: float) -> None:
    """Dispatches D1..Dd then combines C1..Cd on one stream, chunk i's experts between its D and C:
    T = max(2 d a, 2 a + d c, (d + 1) a + c) for per-chunk all-to-all a and compute c."""
    a, c = comm / degree, compute / degree
    timeline = Timeline(world=1)
    dispatched = [timeline.transfer("alltoall", one_resource(a)) for _ in range(degree)]
    computed = [timeline.compute("compute", c, [d]) for d in dispatched]
    for done in computed:
        timeline.transfer("alltoall", one_resource(a), [done])
    timeline.run()
    assert timeline.makespan() == pytest.approx(max(2 * degree * a, 2 * a + degree * c, (degree + 1) * a + c))


def test_per_chunk_latency_is_the_price_of_pipelining() -> None:
    timeline = Timeline(world=1)
    for _ in range(4):
        timeline.transfer("alltoall", Transfer(np.array([0.25, 0.0]), latency_s=0.1))
    timeline.run()
    assert timeline.makespan() == pytest.approx(4 * 0.1 + 1.0)


def test_ring_allreduce_moves_2_w_minus_1_over_w_of_the_buffer() -> None:
    cluster = toy(nodes=4, per_node=1, gap=1e-6, latency=2e-6)
    (ring,) = Network(cluster).allreduce(8e6, "ring")
    w = 4
    steps = 2 * (w - 1)
    expected_busy = steps * 1e-6 + steps * (8e6 / w) / 10e9
    assert float(ring.work.max()) == pytest.approx(expected_busy)
    assert ring.latency_s == pytest.approx(steps * 2e-6)
    (tree,) = Network(cluster).allreduce(8e6, "tree")
    assert float(tree.work.max()) > float(ring.work.max())  # 2 x buffer per node vs 2 (w - 1) / w
    assert Network(cluster).allreduce(8e6, "auto")[0].alone_s == min(ring.alone_s, tree.alone_s)


def test_2dh_sends_fewer_and_larger_messages_than_linear() -> None:
    """With only a per-message gap (infinite bandwidth) busy time counts messages: a node's NIC
    sends g (W - g) messages in the linear all-to-all and g (n - 1) in 2DH's inter-node phase."""
    nodes, per_node, gap = 4, 8, 1e-6
    cluster = Cluster("gaps", nodes, per_node, Device("d", 1e14, 0.0, 1e12),
                      Link(1e30, 0.0, gap), Link(1e30, 0.0, gap))
    network, w = Network(cluster), nodes * per_node
    (linear,) = network.alltoall("linear", 1.0)
    _, intra, _, inter = network.alltoall("2dh", 1.0)
    nic = slice(2 * w, 2 * w + nodes)
    assert linear.work[nic] == pytest.approx(per_node * (w - per_node) * gap)
    assert inter.work[nic] == pytest.approx(per_node * (nodes - 1) * gap)
    assert intra.work[:w] == pytest.approx((per_node - 1) * gap)
    # the byte-matrix path prices a uniform matrix as the scalar path does
    uniform = np.full((w, w), 1.0)
    assert network.alltoall("linear", uniform)[0].work[nic] == pytest.approx(linear.work[nic])
    assert network.alltoall("2dh", uniform)[3].work[nic] == pytest.approx(inter.work[nic])


def test_profile_errors_name_the_field() -> None:
    assert cluster_from_toml(GOOD_PROFILE).world_size == 8
    with pytest.raises(ClusterFileError, match=r"missing field inter_node\.nic_bandwidth_gbit_s"):
        cluster_from_toml(GOOD_PROFILE.replace("nic_bandwidth_gbit_s = 100.0", ""))
    with pytest.raises(ClusterFileError, match=r"intra_node\.bandwidth_gbit_s must be > 0, got -5"):
        cluster_from_toml(GOOD_PROFILE.replace("bandwidth_gbit_s = 800.0", "bandwidth_gbit_s = -5"))
    with pytest.raises(ClusterFileError, match=r"missing table \[device\]"):
        cluster_from_toml(GOOD_PROFILE.replace("[device]", "[devices]"))
    with pytest.raises(ClusterFileError, match="unknown cluster 'nope'"):
        load_cluster("nope")


def test_shipped_profiles_load_and_cite_sources() -> None:
    names = named_clusters()
    assert "tutel-a100" in names
    for name in names:
        cluster = load_cluster(name)
        assert cluster.sources, f"{name} has no [sources]"


def test_skewed_routing_makes_a_straggler_and_padding_hides_it() -> None:
    cluster = toy()
    base = ModelSpec(layers=2, dims=dims(256, 512, 8), tokens_per_rank=512, capacity_factor=0)
    uniform = simulate_step(cluster, base)
    skewed = simulate_step(cluster, base.with_overrides(routing="zipf:1.5"))
    assert skewed.step_s > 1.2 * uniform.step_s  # dropless: the hot expert's rank computes more
    padded = simulate_step(cluster, base.with_overrides(capacity_factor=1.0, routing="zipf:1.5"))
    assert padded.dropped > 0 and uniform.dropped == 0


def test_moeflows_cpu_kernels_pad_the_dropless_backward_and_keep_shadowed_slots_in_the_exchange() -> None:
    """``padded_backward``: the forward runs the real rows, the backward the padded buffer (more
    rows under skew, the same forward). ``shadowed_slots_travel``: the shadowed experts' slots
    travel cut to the others' capacity, between FasterMoE's exchange without them and none shadowed."""
    model = ModelSpec(layers=1, dims=dims(256, 512, 8), tokens_per_rank=512, capacity_factor=0, routing="zipf:1.5")

    def run(**knobs: object) -> StepResult:
        return simulate_step(toy(), model, StepPlan(**knobs), layer_only=True)

    real, padded = run(), run(padded_backward=True)
    assert padded.busy_s["experts"] > 1.2 * real.busy_s["experts"]
    assert simulate_step(toy(), model, StepPlan(padded_backward=True), training=False, layer_only=True).step_s == \
        pytest.approx(simulate_step(toy(), model, StepPlan(), training=False, layer_only=True).step_s)
    load = routing_loads(model, 8)[0]
    hot = np.array([0])
    kept = load.with_shadowed_slots(hot)
    assert kept.counts[0, 0] == load.counts[0, 1:].max() and (kept.counts[:, 1:] == load.counts[:, 1:]).all()
    moved = {flag: run(shadowed=1, shadowed_slots_travel=flag).busy_s["alltoall"] for flag in (False, True)}
    assert moved[False] < moved[True] < run().busy_s["alltoall"]


def test_prioritized_alltoall_is_not_slowed_by_the_gradient_allreduce() -> None:
    model = ModelSpec(layers=8, dims=dims(1024, 1024, 8), tokens_per_rank=2048)
    shared = simulate_step(toy(), model, StepPlan(degree=1))
    first = simulate_step(toy(), model, StepPlan(degree=1, prioritize_alltoall=True))
    assert first.step_s <= shared.step_s
    assert first.busy_s["alltoall"] < shared.busy_s["alltoall"]


def test_step_speed_at_2048_ranks_and_64_layers() -> None:
    import time

    model = ModelSpec(layers=64, dims=dims(2048, 2048, 2048), tokens_per_rank=4096)
    began = time.perf_counter()
    result = simulate_step(load_cluster("tutel-a100"), model, StepPlan(degree=2, algorithm="2dh"))
    assert time.perf_counter() - began < 30  # the 10 s goal is a benchmark figure; this bounds regressions
    assert math.isfinite(result.step_s) and result.operations > 64 * 10


@pytest.mark.slow
def test_simulate_command_prints_a_line_per_plan_and_the_best() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moeflow", "simulate", "--cluster", "tutel-a100", "--nodes", "4", "--layers", "2",
         "--num-experts", "32", "--degree", "1,2", "--algorithm", "linear,2dh"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 5 and out[-1].startswith("# tutel-a100: 4 x 8 = 32 ranks")
    bad = subprocess.run([sys.executable, "-m", "moeflow", "simulate", "--cluster", "tutel-a100", "--algorithm",
                          "ring"], capture_output=True, text=True)
    assert bad.returncode != 0 and "all-to-all algorithm must be one of linear, 2dh, pairwise" in bad.stderr


def test_model_files_read_the_old_experts_key_with_a_warning_and_refuse_both() -> None:
    """``experts`` is ``num_experts``'s old name: a file written before the rename reads as the same
    model (with a FutureWarning naming the new key); a file giving both is refused, naming both."""
    shape = "layers = 2\nmodel_dim = 256\nhidden_dim = 512\ntop_k = 1\n"
    new = model_from_toml(shape + "num_experts = 8\n", "m.toml")
    assert new == ModelSpec(name="m", layers=2, dims=dims(256, 512, 8, top_k=1))
    with pytest.warns(FutureWarning, match="'experts' is renamed 'num_experts'"):
        old = model_from_toml(shape + "experts = 8\n", "m.toml")
    assert old == new
    with pytest.raises(ValueError, match="both 'experts' and 'num_experts'"):
        model_from_toml(shape + "experts = 8\nnum_experts = 8\n", "m.toml")
    with pytest.raises(ValueError, match=r"model file m\.toml: model num_experts must be a positive integer"):
        model_from_toml("num_experts = 0\n", "m.toml")
    with pytest.raises(ValueError, match="model tokens_per_rank must be an integer >= 1"):
        model_from_toml("tokens_per_rank = 0\n", "m.toml")
    with pytest.raises(ValueError, match=r"unknown field\(s\) dims"):
        model_from_toml("[dims]\nmodel_dim = 8\n", "m.toml")


def test_model_overrides_take_the_flat_names_and_shipped_files_use_the_new_key() -> None:
    from moeflow.sim import load_model, named_models

    base = ModelSpec(layers=2, dims=dims(256, 512, 8))
    changed = base.with_overrides(num_experts=16, hidden_dim=None, layers=3, projections=3)
    assert changed.dims == replace(base.dims, num_experts=16, projections=3) and changed.layers == 3
    with pytest.raises(TypeError, match=r"unknown model setting\(s\) experts"):
        base.with_overrides(experts=16)
    with pytest.raises(ValueError, match="top_k=2 is larger than num_experts=1"):
        base.with_overrides(num_experts=1)
    assert ModelSpec().dims.expert_parameters == 2 * 1024 * 4096  # no biases: the simulator's figures
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the shipped files use the new key
        for name in named_models():
            load_model(name)


def test_simulate_command_still_reads_the_old_experts_flag(capsys) -> None:
    from moeflow.cli import main

    with pytest.warns(FutureWarning, match="--experts is renamed --num-experts"):
        assert main(["simulate", "--cluster", "tutel-a100", "--nodes", "2", "--layers", "1", "--experts", "16"]) == 0
    assert '"ranks": 16' in capsys.readouterr().out


MODEL = ModelSpec(layers=2, dims=dims(512, 1024, 16), tokens_per_rank=1024)


def test_adaptive_r1_on_whole_experts_is_the_expert_schedule_and_r0_sends_no_token() -> None:
    cluster = toy()
    expert = simulate_step(cluster, MODEL, StepPlan())
    assert simulate_step(cluster, MODEL, StepPlan("adaptive", r=1)).step_s == pytest.approx(expert.step_s)
    zero = simulate_step(cluster, MODEL, StepPlan("adaptive", r=0))
    assert "alltoall" not in zero.busy_s and zero.busy_s["allgather"] > 0 and zero.busy_s["reducescatter"] > 0
    with pytest.raises(ValueError, match="not a valid r"):
        simulate_step(cluster, MODEL, StepPlan("adaptive", r=3))
    with pytest.raises(ValueError, match="adaptive schedule needs an r"):
        simulate_step(cluster, MODEL, StepPlan("adaptive"))


def test_shadowing_the_hot_expert_removes_the_straggler() -> None:
    skewed = MODEL.with_overrides(routing="zipf:1.5", capacity_factor=0.0)
    plain = simulate_step(toy(), skewed, StepPlan())
    shadowed = simulate_step(toy(), skewed, StepPlan(shadowed=2))
    assert shadowed.step_s < 0.8 * plain.step_s and shadowed.busy_s["broadcast"] > 0
    assert simulate_step(toy(), MODEL, StepPlan(shadowed=0)).step_s == pytest.approx(
        simulate_step(toy(), MODEL, StepPlan()).step_s)


def test_smart_schedule_on_one_node_is_one_intra_node_step() -> None:
    cluster = toy(nodes=1, per_node=4)
    smart = simulate_step(cluster, MODEL, StepPlan("smart"))
    assert smart.step_s == pytest.approx(simulate_step(cluster, MODEL, StepPlan(algorithm="pairwise")).step_s)


def test_joint_planner_ranks_every_mode_and_returns_the_fastest_first() -> None:
    from moeflow.sim.planner import candidate_plans, search

    cluster = toy()
    plans = candidate_plans(cluster, MODEL)
    labels = {plan_label(plan) for plan in plans}
    assert {"expert d=4 2dh", "smart pairwise", "replicated", "adaptive r=0", "expert d=1 linear shadow=2"} <= labels
    top = search(cluster, MODEL, top=3)
    exhaustive = min(simulate_step(cluster, MODEL, plan).step_s for plan in plans)
    assert [r.step_s for r in top] == sorted(r.step_s for r in top)
    assert top[0].step_s == pytest.approx(exhaustive, rel=0.05)  # the few-layer proxy finds the best


def test_calibrated_twin_reproduces_the_primitive_fits() -> None:
    from moeflow.perf.alphabeta import AlphaBeta
    from moeflow.perf.profile import ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile

    fits = {"alltoall.intra_node": AlphaBeta(1e-4, 2e-10), "alltoall.inter_node": AlphaBeta(3e-4, 8e-9),
            "ffn.forward": AlphaBeta(2e-5, 1e-11), "ffn.backward": AlphaBeta(4e-5, 2e-11)}
    cluster = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits))
    assert cluster.device.gemm_flops == pytest.approx(2e11) and cluster.device.backward_ratio == pytest.approx(2)
    # one node's linear all-to-all of x bytes per rank, and one rank per node across nodes
    x = 4e6
    intra = Network(cluster.resized(1, 2)).alltoall("linear", x / 2)[0]
    assert intra.alone_s == pytest.approx(fits["alltoall.intra_node"](x))
    inter = Network(cluster.resized(2, 1)).alltoall("linear", x / 2)[0]
    assert inter.alone_s == pytest.approx(fits["alltoall.inter_node"](x))
    # one expert FFN call on m rows costs the ffn.forward fit, alpha paid once per call (not per kernel)
    from moeflow.sim.step import step_builder

    m, model = 1000, ModelSpec(dims=dims(64, 128, 4))
    builder = step_builder(cluster, model, StepPlan(), layer_only=True)
    assert builder.ffn_s(m, backward=False, local_experts=1) == pytest.approx(fits["ffn.forward"](m * 64 * 128 * 2))
    with pytest.raises(ValueError, match=r"neither alltoall\.intra_node nor alltoall\.inter_node"):
        cluster_from_profile(ClusterProfile(nodes=1, ranks_per_node=1, fits={"gemm": AlphaBeta(0, 1e-12)}))


def test_twin_takes_what_the_probe_layers_calls_leave_unexplained_as_a_fixed_cost_per_call() -> None:
    """The probe layer measured 3 ms (forward) and 5 ms (backward) over the twin's own time for it:
    every simulated layer pays that once per call, a machine twice as fast half of it, and fits
    below the twin's own time give no negative cost."""
    from moeflow.perf.alphabeta import AlphaBeta
    from moeflow.perf.profile import LAYER_PROBE, ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile, retimed

    fits = {"alltoall.inter_node": AlphaBeta(1e-4, 8e-9), "ffn.forward": AlphaBeta(1e-4, 5e-11),
            "ffn.backward": AlphaBeta(2e-4, 1e-10)}
    base = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=1, fits=fits))
    assert (base.device.layer_call_s, base.device.layer_call_backward_s) == (0.0, 0.0)  # no layer fits
    ahead, both = [], []
    for tokens in LAYER_PROBE["tokens"]:
        probe = ModelSpec(layers=1, dims=dims(LAYER_PROBE["model_dim"], LAYER_PROBE["hidden_dim"], 2, top_k=1),
                          capacity_factor=1.0, tokens_per_rank=tokens, dtype="fp32")
        ahead.append(simulate_step(base, probe, training=False, layer_only=True).step_s)
        both.append(simulate_step(base, probe, layer_only=True).step_s)
    backward = [b - a for a, b in zip(ahead, both, strict=True)]
    measured = {"layer.forward": AlphaBeta(float(np.mean(ahead)) + 3e-3, 0.0),
                "layer.backward": AlphaBeta(float(np.mean(backward)) + 5e-3, 0.0)}
    twin = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=1, fits=fits | measured))
    assert (twin.device.layer_call_s, twin.device.layer_call_backward_s) == pytest.approx((3e-3, 5e-3))
    model = MODEL.with_overrides(layers=3)
    gate = [simulate_step(c, model, StepPlan(), layer_only=True).busy_s["gate+encode"] for c in (base, twin)]
    assert gate[1] - gate[0] == pytest.approx(3 * 8e-3)
    assert retimed(twin, 2.0).device.layer_call_backward_s == pytest.approx(2.5e-3)
    below = {name: AlphaBeta(0.0, 0.0) for name in measured}
    floor = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=1, fits=fits | below)).device
    assert (floor.layer_call_s, floor.layer_call_backward_s) == (0.0, 0.0)
    toml = GOOD_PROFILE.replace("[intra_node]", "layer_call_us = 40.0\nlayer_call_backward_us = 60.0\n[intra_node]")
    device = cluster_from_toml(toml).device
    assert (device.layer_call_s, device.layer_call_backward_s) == pytest.approx((40e-6, 60e-6))


def test_twin_scales_each_alltoall_algorithm_to_its_own_fit_and_slows_overlapped_experts() -> None:
    """gloo's linear exchange runs at about half the link's rate here: the twin reads each
    algorithm's slowdown off its fit, and the calibrated interference off the profile."""
    from moeflow.perf.alphabeta import AlphaBeta
    from moeflow.perf.profile import ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile

    link = AlphaBeta(0.0, 8e-9)
    fits = {"alltoall.inter_node": link, "alltoall.linear": AlphaBeta(0.0, 16e-9),
            "alltoall.pairwise": AlphaBeta(0.0, 8e-9), "ffn.forward": AlphaBeta(0.0, 1e-11)}
    twin = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=1, fits=fits, interference=1.25))
    assert twin.collective_scale == pytest.approx({"linear": 2.0, "pairwise": 1.0})  # only fitted collectives
    x = 4e6
    network = Network(twin)
    assert network.alltoall("linear", x / 2)[0].alone_s == pytest.approx(2 * link(x))
    assert sum(s.alone_s for s in network.alltoall("pairwise", x / 2)) == pytest.approx(link(x))
    model = MODEL.with_overrides(layers=1)
    plain = replace(twin, device=replace(twin.device, overlap_slowdown=1.0))
    for degree, slowdown in ((1, 1.0), (2, 1.25)):
        experts = [simulate_step(c, model, StepPlan(degree=degree), layer_only=True).busy_s["experts"]
                   for c in (plain, twin)]
        assert experts[1] == pytest.approx(slowdown * experts[0])
    with pytest.raises(ClusterFileError, match=r"collective_scale\.ring is not a collective"):
        cluster_from_toml(GOOD_PROFILE + "[collective_scale]\nring = 2.0\n")
    assert cluster_from_toml(GOOD_PROFILE + "[collective_scale]\nallreduce = 2.0\n").collective_scale == {
        "allreduce": 2.0}


def test_twin_charges_each_collective_call_its_own_fitted_start_up() -> None:
    """gloo's pairwise exchange starts slower than its linear one (a recorded 2x1 profile: 1.2 ms of
    intercept against none): the twin charges each call the intercept its own fit has beyond what
    its steps already take, once per call, and nothing for a collective whose fit starts no later."""
    from moeflow.perf.alphabeta import AlphaBeta
    from moeflow.perf.profile import ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile

    fits = {"alltoall.inter_node": AlphaBeta(0.0, 8e-9), "alltoall.linear": AlphaBeta(0.0, 16e-9),
            "alltoall.pairwise": AlphaBeta(2e-3, 8e-9), "ffn.forward": AlphaBeta(0.0, 1e-11)}
    twin = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits))
    assert twin.collective_latency == pytest.approx({"pairwise": 2e-3}, abs=1e-7)  # less a byte's time
    assert "collective_latency" in twin.sources
    network, flat = Network(twin), Network(replace(twin, collective_latency={}))
    for x in (0.0, 4e6):
        steps = network.alltoall("pairwise", x / 4)
        assert len(steps) == 2  # the intra-node step, then the inter-node one: one call
        assert sum(s.alone_s for s in steps) == pytest.approx(sum(s.alone_s for s in flat.alltoall("pairwise", x / 4))
                                                              + 2e-3, abs=1e-7)
        assert network.alltoall("linear", x / 4)[0].alone_s == flat.alltoall("linear", x / 4)[0].alone_s
    model = MODEL.with_overrides(layers=1)
    calls = [simulate_step(t, model, StepPlan(degree=4, algorithm="pairwise"), layer_only=True).step_s
             for t in (twin, replace(twin, collective_latency={}))]
    assert calls[0] > calls[1]
    # FasterMoE's smart schedule runs the same exchange step by step: one start-up per exchange too
    smart = [simulate_step(t, model, StepPlan(schedule="smart"), layer_only=True).busy_s["alltoall"]
             for t in (twin, replace(twin, collective_latency={}))]
    expert = [simulate_step(t, model, StepPlan(algorithm="pairwise"), layer_only=True).busy_s["alltoall"]
              for t in (twin, replace(twin, collective_latency={}))]
    assert smart[0] - smart[1] == pytest.approx(expert[0] - expert[1], rel=1e-3) == pytest.approx(8e-3, rel=1e-3)
    # an intercept the twin's own steps already take (an all-reduce's ring latencies) adds nothing
    own = sum(s.alone_s for s in flat.allreduce(1.0))
    slow = cluster_from_profile(ClusterProfile(nodes=2, ranks_per_node=2, fits=fits | {
        "allreduce": AlphaBeta(0.5 * own, 8e-9)}))
    assert "allreduce" not in slow.collective_latency


def test_scaling_report_walks_both_axes_and_fits_exponents() -> None:
    from moeflow.sim.scaling import growth_exponents, scaling_runs

    records = list(scaling_runs(toy(), MODEL, StepPlan(), nodes=(1, 2, 4), layers=(1, 2, 4)))
    assert [(r["ranks"], r["layers"]) for r in records] == [(4, 4), (8, 4), (16, 4), (16, 1), (16, 2)]
    assert all(r["operations"] > 0 for r in records)
    fake = [{"ranks": w, "layers": 4, "wall_s": w * 0.01} for w in (4, 8, 16)] + \
        [{"ranks": 16, "layers": n, "wall_s": 0.04 * n} for n in (1, 2)]
    slopes = growth_exponents(fake)
    assert slopes["ranks"] == pytest.approx(1.0) and slopes["layers"] == pytest.approx(1.0)


def test_validation_pairs_measured_settings_with_the_twin_and_scores_the_pick(tmp_path) -> None:
    from moeflow.bench.sim_validation import compare, summarize
    from moeflow.perf.alphabeta import AlphaBeta
    from moeflow.perf.profile import ClusterProfile

    path = tmp_path / "profile.json"
    ClusterProfile(nodes=2, ranks_per_node=1, fits={"alltoall.inter_node": AlphaBeta(1e-3, 8e-9),
                                                     "ffn.forward": AlphaBeta(1e-4, 5e-11)}).save(path)
    point = {"tokens": 1024, "model_dim": 256, "hidden_dim": 512, "experts_per_rank": 2, "top_k": 2}
    measured = [{"bench": "pipeline", "config": "c", **point, "setting": s, "layer_ms": ms}
                for s, ms in (("d1-linear", 40.0), ("d2-linear", 30.0), ("auto", 1.0))]
    records = compare([*measured, {"bench": "pipeline-ideal"}], path, "2x1", 1.0)
    assert [r["setting"] for r in records] == ["d1-linear", "d2-linear"]  # the fixed settings only
    assert all(r["simulated_ms"] > 0 and r["error"] == pytest.approx(r["simulated_ms"] / r["measured_ms"] - 1,
                                                                      abs=1e-3) for r in records)
    summary = summarize(records)
    picked = min(records, key=lambda r: r["simulated_ms"])
    assert summary["max_regret"] == pytest.approx(picked["measured_ms"] / 30.0 - 1)
    # a training step of bench schedules' model: the expert step is predicted with the plan it ran
    step = {"bench": "schedules", "config": "s", "model_dim": 64, "hidden_dim": 128, "experts": 2, "batch": 2,
            "context": 64, "expert_step_ms": 50.0, "replicated_step_ms": 50.0}
    ran = {d: compare([{**step, "expert_degree": d, "expert_alltoall": "linear"}], path, "2x1", 1.0)[0]
           for d in (1, 4)}
    assert ran[4]["setting"] == "step-expert" and ran[4]["simulated_ms"] != ran[1]["simulated_ms"]
    # Parm's modes on a 2x2 twin: S1, S2 with SAA and the baseline are simulated at N_ESP = N_MP;
    # plain S2 (its combine before the all-gather) and the planner are not
    ClusterProfile(nodes=2, ranks_per_node=2, fits={"alltoall.inter_node": AlphaBeta(1e-3, 8e-9),
                                                     "alltoall.intra_node": AlphaBeta(1e-4, 1e-9),
                                                     "ffn.forward": AlphaBeta(1e-4, 5e-11)}).save(path)
    layer = {"experts": 2, "hidden_dim": 256, "model_dim": 256, "top_k": 2, "capacity_factor": 1.0, "tokens": 1024,
             "mp": 2}
    parm = [{"bench": "parallel", "config": "p", **layer, "mode": m, "r": None, "layer_ms": 50.0}
            for m in ("s1", "s2", "s2-saa", "ds-baseline", "planner")]
    scored = {r["setting"]: r["simulated_ms"] for r in compare(parm, path, "2x2", 1.0)}
    assert set(scored) == {"s1", "s2-saa", "ds-baseline"}
    assert scored["ds-baseline"] > max(scored["s1"], scored["s2-saa"])


def test_validation_retimes_the_twin_to_the_speed_probe_and_predicts_skew_modes(tmp_path) -> None:
    """A benchmark whose probe ran twice as slow as the fits predict is compared with a twin at half
    the compute rate (the twin as calibrated is kept beside it); skew modes are simulated on the
    load they recorded, shadowing, the smart schedule and EPLB's slots included, and bench
    exchange's modes over the token exchange they sent."""
    from moeflow.bench.sim_validation import compare, summarize
    from moeflow.perf.alphabeta import AlphaBeta
    from moeflow.perf.profile import ClusterProfile

    path = tmp_path / "profile.json"
    profile = ClusterProfile(nodes=2, ranks_per_node=1, fits={"alltoall.inter_node": AlphaBeta(1e-3, 8e-9),
                                                               "ffn.forward": AlphaBeta(1e-4, 5e-11),
                                                               "ffn.backward": AlphaBeta(0.0, 1e-10)})
    profile.save(path)
    expected_ms = profile.speed_probe_seconds() * 1e3
    assert expected_ms == pytest.approx((1e-4 + 1.5e-10 * 1024 * 512 * 1024 * 2) * 1e3)
    point = {"tokens": 1024, "model_dim": 256, "hidden_dim": 2048, "experts_per_rank": 2, "top_k": 2}
    measured = [{"bench": "pipeline", "config": "c", **point, "setting": "d1-linear", "layer_ms": 40.0}]
    plain = compare(measured, path, "2x1", 1.0)[0]
    slow = compare([*measured, {"bench": "speed-probe", "measured_by": "pipeline", "config": "c",
                                "probe_ms": 2 * expected_ms}], path, "2x1", 1.0)[0]
    assert plain["speed"] is None and plain["simulated_ms"] == plain["as_calibrated_ms"]
    assert slow["speed"] == pytest.approx(0.5) and slow["as_calibrated_ms"] == plain["simulated_ms"]
    assert slow["simulated_ms"] > 1.3 * plain["simulated_ms"]  # compute-bound: about twice as slow
    assert summarize([slow])["as_calibrated"]["median_abs_error"] == pytest.approx(abs(slow["as_calibrated_error"]))
    skew = {"experts": 4, "hidden_dim": 1024, "model_dim": 256, "tokens": 2048, "top_k": 1, "degree": 1,
            "alltoall": "linear", "tokens_per_expert": [2800, 700, 350, 246]}
    modes = [{"bench": "skew", "config": "z", **skew, "mode": m, "layer_ms": 100.0, "schedule": s, "shadowed": h}
             for m, s, h in (("off", "expert", []), ("auto", "expert", [0]), ("smart", "smart", []),
                             ("redundant", "expert", []))]
    scored = {r["setting"]: r["simulated_ms"] for r in compare(modes, path, "2x1", 1.0)}
    assert set(scored) == {"skew-off", "skew-auto", "skew-smart"}  # a record without its slots is skipped
    assert scored["skew-auto"] < scored["skew-off"]  # the hot expert's tokens stay home
    # records that carry their slots and token exchange: EPLB's slots and balance='auto' as it chose
    ragged = [{**mode, "token_exchange": "ragged", "slots": 4 if mode["mode"] != "redundant" else 6}
              for mode in modes if mode["mode"] != "smart"]
    ragged.append({**ragged[0], "mode": "balance", "slots": 6})
    scored = {r["setting"]: r["simulated_ms"] for r in compare(ragged, path, "2x1", 1.0)}
    assert set(scored) == {"skew-off", "skew-auto", "skew-redundant", "skew-balance"}
    assert scored["skew-balance"] == scored["skew-redundant"] < scored["skew-off"]
    exchange = {"bench": "exchange", "config": "x", **skew, "capacity_factor": 0.0, "train_step_ms": 80.0}
    sent = {r["setting"]: r["simulated_ms"] for r in compare(
        [{**exchange, "mode": m, "token_exchange": t} for m, t in (("padded", "padded"), ("ragged", "ragged"),
                                                                   ("padded-bmm", "padded"))], path, "2x1", 1.0)}
    assert set(sent) == {"exchange-padded", "exchange-ragged"} and sent["exchange-ragged"] < sent["exchange-padded"]


def test_plan_command_runs_the_joint_planner_and_needs_one_source(capsys) -> None:
    from moeflow.cli import main

    assert main(["plan", "--cluster", "fastermoe-johnny", "--model", "fastermoe-gpt", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].startswith('{"rank": 1') and "best plan" in lines[-1]
    with pytest.raises(SystemExit, match=r"pass --profile .* or --cluster"):
        main(["plan"])
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        main(["plan", "--cluster", "lina-a100", "--model", "nope"])


def test_paper_trends_put_simulated_cells_beside_the_published_ones(tmp_path) -> None:
    """Lina's contention comes out of the link model (no constant): backward all-to-alls beside the
    gradient all-reduce are slower than served first; FasterMoE's shadowing speeds up skewed GPTs."""
    from moeflow.bench.paper_trends import fastermoe_fig13, lina_contention, plot, summarize

    lina = {r["cell"]: r for r in lina_contention()}
    median, worst = (lina[f"{k} backward all-to-all slowdown"]["simulated"] for k in ("median", "worst"))
    speedup = lina["step speedup, priority with tensor partitioning (16 experts)"]["simulated"]
    assert 1.0 <= median <= worst and worst > 1.5 and speedup > 1
    assert 1.5 < lina["median slowdown of those"]["simulated"] <= 2.0 + 1e-6  # two flows share the NIC
    assert 0 < lina["share of backward all-to-alls beside an all-reduce"]["simulated"] < 1
    assert all(r["simulated_over_published"] == pytest.approx(r["simulated"] / r["published"], rel=1e-2)
               for r in lina.values() if r["published"])
    faster = list(fastermoe_fig13())
    assert all(r["simulated"] > 1.0 for r in faster if "shadowing" in r["cell"])
    assert [r["published"] for r in faster if r["published"]] == [1.95, 1.40, 2.20]
    summary = summarize([*lina.values(), *faster])
    assert summary["tables"]["lina section 2.2"]["cells"] == 2  # the median of those beside one, the worst
    fig13 = summary["tables"]["fastermoe Fig. 13"]  # the MoE layers alone, as FasterMoE measured (§5.2)
    assert fig13["median_within_band"] and fig13["share_within_cell_band"] == 1.0
    assert summary["tables_meeting_both"] == 1
    assert [p.name for p in plot([*lina.values(), *faster], tmp_path)] == [
        "papers-lina-section22.png", "papers-lina-section72.png", "papers-fastermoe-fig13.png"]


PARM_MODEL = ModelSpec(layers=2, dims=dims(512, 1024, 8, top_k=1), capacity_factor=1.0, tokens_per_rank=1024)


@pytest.mark.parametrize("layer_only", [True, False])
def test_parm_schedules_without_mp_or_esp_are_plain_expert_parallelism(layer_only: bool) -> None:
    """At N_MP = N_ESP = 1 the fused all-to-all is the linear one, the baseline's EP group is the
    world and nothing is gathered or reduced: all three price exactly as expert d=1 linear."""
    plain = simulate_step(toy(), PARM_MODEL, StepPlan(), layer_only=layer_only).step_s
    for schedule in ("s1", "s2", "ds-baseline"):
        parm = simulate_step(toy(), PARM_MODEL, StepPlan(schedule=schedule), layer_only=layer_only).step_s
        assert parm == pytest.approx(plain, rel=1e-12)


def test_parm_removes_the_baselines_repeated_work_and_traffic() -> None:
    """N_MP = N_ESP = 2 on 2 x 4 ranks: the baseline's expert shards run N_MP times S1's rows; S1
    and S2 send N_ESP / N_MP = 1 buffer over every rank, the baseline N_ESP buffers over its EP
    group (ranks equal mod 2) plus the ESP all-gather and all-reduce; MP attention halves."""
    cluster, model = toy(), PARM_MODEL
    runs = {s: simulate_step(cluster, model, StepPlan(schedule=s, mp=2, esp=2), layer_only=True)
            for s in ("s1", "s2", "ds-baseline")}
    base, s1, s2 = runs["ds-baseline"], runs["s1"], runs["s2"]
    assert base.busy_s["experts"] == pytest.approx(2 * s1.busy_s["experts"])
    assert s1.busy_s["experts"] == pytest.approx(s2.busy_s["experts"])
    assert "allgather-esp" in base.busy_s and "allreduce-esp" in base.busy_s and "allgather-mp" in s1.busy_s
    assert base.step_s > 2 * max(s1.step_s, s2.step_s)
    slots = 128  # C
    network, buffer = Network(cluster), model.dims.num_experts * slots * model.dims.model_dim * model.element_bytes
    (strided,) = network.strided_alltoall(2 * buffer / 4, 2)
    (fused,) = network.alltoall("linear", buffer / 8)
    nic = 2 * cluster.world_size
    assert strided.work[nic] == pytest.approx(4 * 2 * 2 * buffer / 4 / 10e9)  # 4 ranks x 2 remote peers
    assert fused.work[nic] == pytest.approx(4 * 4 * buffer / 8 / 10e9)
    whole = {mp: simulate_step(cluster, model, StepPlan(schedule="s1", mp=mp, esp=mp)) for mp in (1, 2)}
    assert whole[2].busy_s["attention"] == pytest.approx(whole[1].busy_s["attention"] / 2)
    assert "allreduce-mp" in whole[2].busy_s and "allreduce-mp" not in whole[1].busy_s
    (reduce_scatter, all_gather) = network.allreduce(1e6, group=2)
    assert float(reduce_scatter.work.max()) == pytest.approx(0.5e6 / 100e9)  # one ring step of half
    assert float(all_gather.work.max()) == pytest.approx(0.5e6 / 100e9) and reduce_scatter.work[nic:].max() == 0


@pytest.mark.parametrize("schedule", ["s1", "s2", "ds-baseline"])
def test_parm_schedules_pipeline_over_capacity_chunks(schedule: str) -> None:
    """At degree d each Parm region runs d chunks of the same rows and bytes: the experts' and the
    all-to-alls' busy time only gain the per-kernel and per-message overheads, and the chunks'
    overlap makes the layer faster when compute and the exchange are comparable."""
    cluster, model = toy(), PARM_MODEL
    runs = {d: simulate_step(cluster, model, StepPlan(schedule=schedule, degree=d, mp=2, esp=2), layer_only=True)
            for d in (1, 4)}
    assert runs[4].operations > runs[1].operations
    assert runs[4].busy_s["experts"] == pytest.approx(runs[1].busy_s["experts"], rel=0.05)
    assert runs[4].busy_s["alltoall"] >= runs[1].busy_s["alltoall"] * 0.999
    assert runs[4].step_s < runs[1].step_s
    assert plan_label(StepPlan(schedule=schedule, degree=4, mp=2, esp=2)).endswith("d=4 mp=2 esp=2")


def test_packed_s1_sends_only_occupied_slots() -> None:
    """moeflow's S1 packs its own tokens' slots: at f = 2 half the capacity is empty, so it moves
    half of Parm's S1 bytes; at f = 1 under uniform routing every slot is filled and nothing changes."""
    def alltoall(factor: float, packed: bool) -> float:
        model = PARM_MODEL.with_overrides(capacity_factor=factor)
        plan = StepPlan(schedule="s1", mp=2, esp=2, packed_s1=packed)
        return simulate_step(toy(), model, plan, layer_only=True).busy_s["alltoall"]

    assert alltoall(2.0, True) == pytest.approx(alltoall(2.0, False) / 2, rel=0.05)
    assert alltoall(1.0, True) == pytest.approx(alltoall(1.0, False))


def test_parm_plans_reject_layouts_they_cannot_run() -> None:
    with pytest.raises(ValueError, match="mp and esp > 1 go with Parm's schedules"):
        simulate_step(toy(), PARM_MODEL, StepPlan(mp=2))
    with pytest.raises(ValueError, match=r"esp \(3\) must divide the 4 GPUs per node"):
        simulate_step(toy(), PARM_MODEL, StepPlan(schedule="s1", esp=3))
    with pytest.raises(ValueError, match="experts do not divide over the 8 EP ranks"):
        simulate_step(toy(), PARM_MODEL.with_overrides(num_experts=4), StepPlan(schedule="s2"))


def test_joint_planner_behind_mp_attention_chooses_among_parms_schedules() -> None:
    from moeflow.sim.planner import SearchSpace, candidate_plans, search

    space = SearchSpace(mp=2, ep_sizes=(toy().world_size,))
    plans = candidate_plans(toy(), PARM_MODEL, space)
    assert {p.schedule for p in plans} == {"s1", "s2", "ds-baseline"} and all(p.mp == 2 for p in plans)
    best = search(toy(), PARM_MODEL, top=2 * len(plans), space=space)  # each under two gradient syncs
    assert best[0].plan.schedule in ("s1", "s2") and best[-1].plan.schedule == "ds-baseline"
    with pytest.raises(ValueError, match="--mp 3 must divide the 4 GPUs per node"):
        candidate_plans(toy(), PARM_MODEL, SearchSpace(mp=3))


def test_parm_table4_is_reproduced_within_a_third() -> None:
    """Every simulated average speedup over DeepSpeed-MoE lies within 0.75..1.33 of the published
    one, and the gains grow with N_MP as in the paper."""
    from moeflow.bench.paper_trends import parm_table4

    rows = list(parm_table4())
    assert len(rows) == 4 * 4 * 3
    assert all(0.75 <= r["simulated_over_published"] <= 1.33 for r in rows), \
        [(r["cell"], r["simulated_over_published"]) for r in rows]
    s1 = {r["cell"]: r["simulated"] for r in rows if " s1 " in r["cell"]}
    assert s1["T-B 32 GPUs s1 mp=4 esp=4"] > s1["T-B 32 GPUs s1 mp=2 esp=4"] > 2


def test_layer_auto_ranks_its_candidates_on_the_profiles_twin() -> None:
    """pipeline='auto' with a profile that makes a twin times the simulator's top plans first; a
    profile without all-to-all link fits keeps the cost model's ranking."""
    from moeflow.parallel.online_planner import OnlinePlanner
    from moeflow.perf import AlphaBeta, ClusterProfile, CostModel
    from moeflow.perf.shape import RegionShape
    from moeflow.sim.layer_ranking import SimulatedRanker, region_model, step_plan

    fits = {"gemm": AlphaBeta(2e-5, 1.3e-11), "ffn.forward": AlphaBeta(1e-4, 1.3e-11),
            "ffn.backward": AlphaBeta(2e-4, 2.6e-11), "alltoall.inter_node": AlphaBeta(0.0, 8e-9),
            "alltoall.linear": AlphaBeta(0.0, 16e-9), "alltoall.pairwise": AlphaBeta(1e-4, 8e-9)}
    profile = ClusterProfile(nodes=2, ranks_per_node=1, fits=fits)
    shape = RegionShape(LayerDims(256, 512, 8), world_size=2, capacity=512)
    assert region_model(shape).tokens_per_rank * region_model(shape).dims.top_k // 8 == 512  # the capacity
    planner = OnlinePlanner("auto", ("linear", "pairwise"), CostModel(profile), reduce_max=list,
                              ranker=SimulatedRanker.from_profile)
    assert planner._simulator is not None
    ranked = planner._simulated(shape, range(1, 17), backward=True)
    twin = planner._simulator.twin
    seconds = [simulate_step(twin, region_model(shape), step_plan(p), layer_only=True).step_s for p, _ in ranked]
    assert seconds == sorted(seconds) and ranked[0][0].algorithm == "pairwise"  # half the linear's link time
    planner.choose(shape, backward=True)  # the untimed warm-up opens the search
    (search,) = planner._searches.values()
    assert search.candidates[:3] == [p for p, _ in ranked[:3]]
    links_only = {k: v for k, v in fits.items() if k != "alltoall.inter_node"}
    fallback = OnlinePlanner("auto", ("linear", "pairwise"), CostModel(replace(profile, fits=links_only)),
                               reduce_max=list, ranker=SimulatedRanker.from_profile)
    assert fallback._simulator is None and fallback._simulated(shape, range(1, 17), True) is None


def test_the_simulators_picks_are_the_measured_best_of_a_recorded_validation_run() -> None:
    """Replays a recorded emulated-cluster run (tests/data/sim_validation): per layout, bandwidth
    and config, the setting the twin ranks first is the measured best or close to it (the issue's
    median regret <= 5 %); the twin's times are the measured ones within the stated noise."""
    import statistics
    from pathlib import Path

    from moeflow.bench.sim_validation import regrets, replay, summarize

    records = replay(Path(__file__).parent / "data" / "sim_validation")
    assert {r["measured_by"] for r in records} == {"pipeline", "schedules", "parallel", "skew", "exchange"}
    assert {(r["layout"], r["inter_gbit"]) for r in records} == {(f"2x{g}", b) for g in (1, 2) for b in (0.5, 1, 2)}
    found = regrets(records)
    assert len(found) == 78 and statistics.median(found) <= 0.05
    summary = summarize(records)
    # the median target (10 %) holds on this recording (7.5 %) and per layout; its max (25 %)
    # does not (38 %: the padded exchange at 2x2, 1 Gbit/s); these bounds keep the figures from regressing
    assert summary["median_abs_error"] <= 0.08
    assert all(layout["median_abs_error"] <= 0.08 for layout in summary["by_layout"].values())
    errors = [abs(r["error"]) for r in records]
    assert sum(e <= 0.25 for e in errors) >= 0.93 * len(errors) and max(errors) <= 0.4


def test_a_ragged_exchange_sends_the_kept_rows_only_under_skew() -> None:
    """``ragged_exchange``: dropless under skew the padded exchange sends every expert's slots up to
    the hottest one's count, the ragged one the kept rows; at a full uniform load they agree."""
    cluster = toy(nodes=2, per_node=1)
    skewed = ModelSpec(layers=1, dims=dims(256, 512, 8), tokens_per_rank=512, capacity_factor=0, routing="zipf:1.5")
    padded = simulate_step(cluster, skewed, StepPlan(), layer_only=True)
    ragged = simulate_step(cluster, skewed, StepPlan(ragged_exchange=True), layer_only=True)
    assert ragged.busy_s["alltoall"] < 0.6 * padded.busy_s["alltoall"]
    uniform = ModelSpec(layers=1, dims=dims(256, 512, 8), tokens_per_rank=512, capacity_factor=1.0)
    both = [simulate_step(cluster, uniform, StepPlan(ragged_exchange=r), layer_only=True) for r in (False, True)]
    assert both[1].busy_s["alltoall"] <= both[0].busy_s["alltoall"] * 1.001


def test_auto_sends_a_full_chunk_padded_and_a_sparse_one_ragged() -> None:
    """``token_exchange='auto'`` (``ragged_min_saving``): a chunk whose slots are nearly all filled
    travels padded, as the layer sends it; one with enough of them empty travels ragged."""
    cluster = toy(nodes=2, per_node=1)
    spec = ModelSpec(layers=1, dims=dims(256, 512, 8), tokens_per_rank=512, capacity_factor=0, routing="zipf:1.5")
    auto = StepPlan(ragged_exchange=True, ragged_min_saving=0.1)

    def exchanged_s(plan: StepPlan, counts: np.ndarray) -> float:
        loads = [LayerLoad(np.tile(counts, (2, 1)).astype(np.float64))]
        return simulate_step(cluster, spec, plan, loads=loads, layer_only=True).busy_s["alltoall"]

    nearly_full = np.full(8, 128.0)
    nearly_full[[0, 4]] = 124.0  # under 1 % of the slots empty, some on every rank's link
    assert exchanged_s(auto, nearly_full) == pytest.approx(exchanged_s(StepPlan(), nearly_full))
    assert exchanged_s(StepPlan(ragged_exchange=True), nearly_full) < exchanged_s(StepPlan(), nearly_full)
    skewed = np.array([512.0, 128, 64, 64, 64, 64, 64, 64])  # 62 % of the slots empty
    assert exchanged_s(auto, skewed) == pytest.approx(exchanged_s(StepPlan(ragged_exchange=True), skewed))


def test_a_ranks_tokens_for_its_own_slots_stay_off_the_link() -> None:
    """EPLB's slots (``ReplicaRowMap``): a rank's tokens for a replica on its own rank are computed
    at home, so the padded exchange pads only what travels. The emulated 2x1 cluster's Zipf(1.5)
    load (the hot expert replicated on both ranks) sends under a third of the bytes without slots."""
    cluster = toy(nodes=2, per_node=1)
    spec = ModelSpec(layers=1, dims=dims(256, 1024, 4), tokens_per_rank=2048, capacity_factor=0)
    load = [LayerLoad(np.tile([1261.0, 411, 218, 157], (2, 1)))]
    off, slots = (simulate_step(cluster, spec, StepPlan(redundant_slots=n), loads=load, layer_only=True)
                  for n in (0, 2))
    assert slots.busy_s["alltoall"] < off.busy_s["alltoall"] / 3
    assert slots.busy_s["experts"] < off.busy_s["experts"]  # and the ranks even out


def test_a_per_peer_gap_grows_the_linear_all_to_alls_startup_with_the_rank_count() -> None:
    """PipeMoE Fig. 6(b): the linear all-to-all's startup at 16, 32 and 64 GPUs (17, 209 and 783 us)
    grows faster than the message count; the per-peer gap reproduces its scale, 2DH's inter-node
    phase (n - 1 peers) pays little of it, and a profile without the term is unchanged."""
    from moeflow.perf.sim.network import Network
    from moeflow.sim import load_cluster

    base = load_cluster("pipemoe-2080ti")
    startup = {}
    for gpus in (16, 32, 64):
        (step,) = Network(base.resized(gpus // base.gpus_per_node)).alltoall("linear", 0.0)
        startup[gpus] = float(step.work.max())
    assert startup[16] < startup[32] < startup[64] and startup[64] == pytest.approx(783e-6, rel=0.05)
    assert startup[64] / startup[16] > 240 / 48  # faster than the messages a node sends
    flat = replace(base, nic=replace(base.nic, message_overhead_per_peer_s=0.0))
    (none,) = Network(flat).alltoall("linear", 0.0)
    assert float(none.work[2 * flat.world_size:].max()) == 0.0  # the NICs: no bytes, no gap
    two_dim = Network(base).alltoall("2dh", 0.0)[-1]
    assert float(two_dim.work.max()) < startup[64] / 10


def test_ranks_sharing_cores_pass_an_idle_ranks_core_to_the_busy_ones() -> None:
    """Processor sharing: 4 ranks on 2 cores run at half a core each when all are busy (the
    calibrated rate); under a skew the ranks that finish pass their cores on, so the hot rank ends
    sooner than at the calibrated rate, never sooner than on a core of its own."""
    from moeflow.perf.sim.cores import shared_core_seconds

    even = np.full(4, 2.0)
    assert shared_core_seconds(even, 2, 4) == pytest.approx(even)
    skewed = np.array([8.0, 2.0, 2.0, 2.0])  # seconds at half a core each
    finish = shared_core_seconds(skewed, 2, 4)
    # all four share until the cold ones end at 2 s (1 core-second each); then the hot one has a core
    assert finish == pytest.approx([2.0 + (4.0 - 1.0), 2.0, 2.0, 2.0])
    assert finish[0] >= skewed[0] / 2  # at most one core: never faster than alone on a core
    assert shared_core_seconds(skewed, 4, 4) == pytest.approx(skewed)  # a core each: nothing shared
    two_machines = shared_core_seconds(np.concatenate([skewed, even]), 2, 4)
    assert two_machines == pytest.approx(np.concatenate([finish, even]))


def test_the_calibrated_twin_knows_which_ranks_share_cores() -> None:
    """A gloo profile of the emulated cluster (every rank on the calibrating machine) shares its
    cores among all ranks; a real CPU cluster among a node's; a GPU profile not at all. The twin of
    the recorded 2x2 run then prices a skewed dropless layer lower than at the calibrated rate."""
    from pathlib import Path

    from moeflow.perf.profile import ClusterProfile
    from moeflow.sim.calibrated import cluster_from_profile, shared_cores

    machine = {"cpus": 2, "threads_per_rank": 1, "backend": "gloo", "latency_emulated": "0"}
    assert shared_cores(ClusterProfile(nodes=2, ranks_per_node=2, fits={}, machine=machine)) == (2, 4)
    real = {k: v for k, v in machine.items() if k != "latency_emulated"}
    assert shared_cores(ClusterProfile(nodes=2, ranks_per_node=2, fits={}, machine=real)) == (0, 0)  # a core each
    assert shared_cores(ClusterProfile(nodes=2, ranks_per_node=4, fits={}, machine=real)) == (2, 4)
    nccl = real | {"backend": "nccl"}
    assert shared_cores(ClusterProfile(nodes=2, ranks_per_node=4, fits={}, machine=nccl)) == (0, 0)
    twin = cluster_from_profile(ClusterProfile.load(Path(__file__).parent / "data" / "sim_validation" /
                                                    "profile-2x2-1gbit.json"))
    assert (twin.device.cores, twin.device.ranks_per_machine) == (2, 4)
    model = ModelSpec(layers=1, dims=dims(512, 1024, 8), capacity_factor=0.0, tokens_per_rank=2048,
                      routing="zipf:1.5", dtype="fp32")
    alone = replace(twin, device=replace(twin.device, cores=0, ranks_per_machine=0))
    shared, busy = (simulate_step(c, model, StepPlan(), layer_only=True).step_s for c in (twin, alone))
    assert shared < 0.9 * busy
    uniform = model.with_overrides(routing="uniform")
    assert simulate_step(twin, uniform, StepPlan(), layer_only=True).step_s == pytest.approx(
        simulate_step(alone, uniform, StepPlan(), layer_only=True).step_s)
