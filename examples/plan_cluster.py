"""Plan an MoE training job for a cluster you do not have, on moeflow's simulator.

Run it with one of the shipped cluster and model profiles (``moeflow simulate --list`` names them),
or with your own TOML files::

    python examples/plan_cluster.py
    python examples/plan_cluster.py --cluster tutel-a100 --model tutel-fig14 --nodes 4
    python examples/plan_cluster.py --cluster my-cluster.toml --model my-model.toml

It loads the cluster (nodes x GPUs, their links and compute) and the model (layers, dimensions,
experts, tokens per GPU, how skewed the routing is), simulates one training step of plain expert
parallelism as a baseline, then asks the planner for the fastest plans: the schedule, pipeline
degree, all-to-all algorithm and experts shadowed (FasterMoE), each simulated over the whole step
(forward, backward, gradient all-reduce, optimizer). ``moeflow plan --cluster`` prints the same
search as JSON lines.

The last line it prints is a JSON summary (the best plan and its speedup over the baseline).
"""

from __future__ import annotations

import argparse
import json

from moeflow.sim import StepPlan, load_cluster, load_model, plan_label, simulate_step
from moeflow.sim.planner import search


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="fastermoe-johnny",
                        help="a shipped cluster's name or a TOML cluster file (default fastermoe-johnny)")
    parser.add_argument("--model", default="fastermoe-gpt",
                        help="a shipped model's name or a TOML model file (default fastermoe-gpt)")
    parser.add_argument("--nodes", type=int, default=None, help="resize the cluster to this many nodes")
    parser.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    parser.add_argument("--top", type=int, default=3, help="how many plans to print (default 3)")
    parser.add_argument("--inference", action="store_true", help="plan one forward batch, not a training step")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cluster = load_cluster(args.cluster)
    if args.nodes:
        cluster = cluster.resized(args.nodes)
    model = load_model(args.model).with_overrides(layers=args.layers)  # None leaves a setting as it is
    training = not args.inference
    unit = "step" if training else "batch"
    print(f"{cluster.name}: {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {cluster.world_size} ranks")
    print(f"{model.name}: {model.layers} layers, {model.dims.num_experts} experts, top-{model.dims.top_k}, "
          f"routing {model.routing}")

    baseline = simulate_step(cluster, model, StepPlan("expert", 1, "linear"), training)
    print(f"baseline  {plan_label(baseline.plan):<32} {baseline.step_s * 1e3:10.2f} ms per {unit}")

    results = search(cluster, model, training=training, top=args.top)  # fastest first
    for place, result in enumerate(results, 1):
        largest = sorted(result.busy_s.items(), key=lambda item: -item[1])[:3]  # where the time goes
        busy = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in largest)
        label = plan_label(result.plan)
        print(f"plan {place}    {label:<32} {result.step_s * 1e3:10.2f} ms per {unit}  (busiest: {busy})")

    best = results[0]
    print(json.dumps({"example": "plan_cluster", "cluster": cluster.name, "model": model.name,
                      "best_plan": plan_label(best.plan), "best_ms": round(best.step_s * 1e3, 4),
                      "baseline_ms": round(baseline.step_s * 1e3, 4),
                      "speedup": round(baseline.step_s / best.step_s, 3)}))


if __name__ == "__main__":
    main()
