"""Benchmarks: each prints one JSON object per measurement and a summary line."""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from typing import Any

from moeflow.files import json_text
from moeflow.progress import Progress, Quiet

POINT_DONE = "# grid point done"
"""What rank 0 of a grid benchmark prints after each point: the driver counts them (its progress)."""


def record_fields(point: Any) -> dict[str, Any]:
    """A benchmark point's (dataclass) fields under the keys of its JSON records: ``num_experts`` is
    ``experts`` there, the key that dated records and the simulator's validation read."""
    return {("experts" if key == "num_experts" else key): value for key, value in asdict(point).items()}


class RankZeroRecords(io.StringIO):
    """A sink for :func:`moeflow.testbed.launch`: keeps all output, and collects and prints rank
    0's JSON lines (with ``extra`` fields merged in) as they arrive; rank 0's :data:`POINT_DONE`
    lines advance ``progress``."""

    def __init__(self, progress: Progress | None = None, **extra: Any) -> None:
        super().__init__()
        self.extra, self.progress = extra, progress or Quiet()
        self.records: list[dict[str, Any]] = []
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if line.startswith("[rank 0] {"):
                record = {**json.loads(line.removeprefix("[rank 0] ")), **self.extra}
                self.records.append(record)
                print(json_text(record), flush=True)
            elif line == f"[rank 0] {POINT_DONE}":
                self.progress.advance()
        return super().write(text)


def cluster_profile(path: str | None, save_to: str | None, bench: str, emit: Any) -> Any:
    """Inside a launched cluster: the profile at ``path``, or calibrate this cluster now (every
    rank takes part; rank 0 reports the calibration's quality and saves it to ``save_to``)."""
    import os
    import time

    import torch.distributed as dist

    from moeflow.calibrate import CalibrationConfig, calibrate_rank
    from moeflow.comm.collectives import broadcast_objects
    from moeflow.comm.topology import topology_from_environment
    from moeflow.perf import ClusterProfile

    if path:
        return ClusterProfile.load(path)
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = topology_from_environment(os.environ, world).ranks_per_node
    latency = os.environ.get("MOEFLOW_TESTBED_LATENCY_EMULATED")
    config = CalibrationConfig(repeats=3, ranks_per_node=per_node, latency_emulated=latency)
    values = [calibrate_rank(rank, world, config)]
    broadcast_objects(values, 0)
    profile = ClusterProfile.from_dict(values[0])
    if rank == 0:
        if save_to:
            profile.save(save_to)
        fits = profile.quality["fits"]
        emit({"bench": f"{bench}-calibration", "seconds": time.perf_counter() - start,
              "min_r2": min(f["r2"] for f in fits), "interference": profile.interference,
              "max_heldout_median_rel_error": max(f["heldout_median_rel_error"] for f in fits)})
    return profile


def run_on_cluster(
    module: str, name: str, grid: list[Any], nodes: int, ranks_per_node: int, inter_gbit: float, repeats: int,
    profile: str | None, master_port: int, timeout_s: float, calibrate: bool = True, save_profile: str | None = None,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Launch an emulated cluster that runs ``python -m module`` as every rank over a grid of
    dataclass points (calibrating first, into ``save_profile`` when given, unless ``profile`` is given
    or ``calibrate`` is off);
    return rank 0's records, printed as they come. ``progress`` counts the points done."""
    import json
    import os
    import sys
    import tempfile
    from dataclasses import asdict

    from moeflow.testbed import ClusterSpec, launch

    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", module, "--grid", json.dumps([asdict(p) for p in grid]),
                   "--repeats", str(repeats)]
        if not calibrate:
            command += ["--no-profile"]
        elif profile:
            command += ["--profile", profile]
        else:
            command += ["--save-profile", save_profile or os.path.join(folder, "profile.json")]
        sink = RankZeroRecords(progress, nodes=nodes, ranks_per_node=ranks_per_node, inter_gbit=inter_gbit)
        sink.progress.expect(len(grid))
        code = launch(ClusterSpec(nodes, ranks_per_node, inter_gbit), command, master_port=master_port,
                      timeout_s=timeout_s, sink=sink)
        if code:
            raise RuntimeError(f"{name} benchmark failed (exit {code}):\n{sink.getvalue()[-4000:]}")
    return sink.records


def grid_rank_main(argv: list[str], bench: str, measure: Any) -> None:
    """Every rank of a grid benchmark on the emulated cluster: parse the driver's arguments, join
    the job (one intra-op thread), get the profile (given, or calibrated now), and call
    ``measure(point_values, groups, profile, repeats, emit)`` for each grid point."""
    import argparse
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from moeflow.comm.groups import ParallelGroups
    from moeflow.comm.topology import topology_from_environment
    from moeflow.distributed import destroy_process_groups

    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", required=True, help="JSON list of grid points")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--save-profile", default=None)
    parser.add_argument("--no-profile", action="store_true", help="measure without a cluster profile")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    groups = ParallelGroups(dist.group.WORLD, topology_from_environment(os.environ, dist.get_world_size()))

    def emit(record: dict[str, Any]) -> None:
        print(json_text(record), flush=True)

    profile = None if args.no_profile else cluster_profile(args.profile, args.save_profile, bench, emit)
    for values in json.loads(args.grid):
        measure(values, groups, profile, args.repeats, emit)
        if dist.get_rank() == 0:
            print(POINT_DONE, flush=True)
    destroy_process_groups()
