"""Simulator speed: simulated requests per wall (and CPU) second at 64, 256 and 1,024 GPUs.

The clusters are ``examples/cluster-1024.yaml`` scaled down (every line's count times
1/16 and 1/4, at least 1), so all three have the same mix of GPU types, models and
TP degrees. The workload is the Azure conversation trace replayed at a rate
proportional to the GPU count (``--workloads``: the Azure conversation trace and the
shipped Mooncake trace, whose ~15k-token prompts are the slow case), at two operating
points:

* ``seed``: the issue's reference load, seed 000's 1,024-GPU cluster serving 6.2 M
  requests a day (72 req/s at 1,024 GPUs, scaled by GPUs);
* ``busy``: 0.5 req/s per GPU (512 req/s at 1,024 GPUs: TTFT P95 well under a second
  in simulation, most backends busy).

Each configuration runs ``--repeat`` times (default 3; the box is shared, so wall
times vary from run to run); each row prints the median and the best simulated
requests per wall second, the median per CPU second (the event loop's own CPU time,
less sensitive to a busy machine) and the real-time factor (simulated seconds per
wall second), against the targets at 1,024 GPUs: >= 10,000 simulated requests per wall
second on Azure conversations, >= 5,000 on Mooncake. The verdict is on the median; a
miss is printed as a miss.

Run: ``.venv/bin/python benchmarks/sim_speed.py [--num-requests N] [--policy P]``: the
default build, as ``kiloserve sim`` picks it (compiled when a build matches the sources,
``KILOSERVE_SIM_BUILD`` to force; docs/simulator.md). ``--compiled`` builds first when
missing or stale and measures the compiled build; ``--both`` runs the pure and the
compiled build, each in its own process, and prints the compiled/pure ratio. Every row
and target line names the build it measured.

``--profile N`` runs each configuration once more under cProfile and prints its N
functions with the most own time (pure Python shows every function; in the compiled
build the compiled ones are folded into their interpreted callers):
``.venv/bin/python benchmarks/sim_speed.py --sizes 1024 --loads busy --repeat 1
--workloads mooncake --num-requests 5000 --profile 25``.

``--day`` runs the issue's literal case instead: one simulated day (86,400 s) of the
1,024-GPU cluster at the reference rate (6.2 M requests), the Azure conversation
trace replayed back to back (``azure-conv:repeat=inf``), and prints the requests, the
event loop's wall and CPU time, the whole run's wall time and peak memory against
the 10-minute target. It takes 10-20 minutes; add ``--compiled`` for the mypyc build.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiloserve.launch.config import ClusterConfig, load_cluster_config, parse_cluster_config
from kiloserve.sim.build import loaded_build, select_build

ROOT = Path(__file__).resolve().parents[1]
TARGETS_PER_WALL_S = {"azure-conv": 10_000, "mooncake": 5_000}
TARGET_REQUESTS_PER_WALL_S = TARGETS_PER_WALL_S["azure-conv"]
SEED_REQUESTS_PER_DAY_1024 = 6_200_000
LOADS_PER_GPU = {"seed": SEED_REQUESTS_PER_DAY_1024 / 86_400 / 1024, "busy": 0.5}
SIZES = (64, 256, 1024)
# Requests per run unless --num-requests: a Mooncake run's memory grows with the KV
# blocks the cluster caches (~360 KB per request at 1,024 GPUs until the caches fill:
# 1.3 GB at 3,000 requests; 20,000 were OOM-killed at 12 GB on a 23 GB box)
DEFAULT_REQUESTS = {"azure-conv": 20_000, "mooncake": 3_000}
HEADER = (
    f"{'workload':<10} {'load':<5} {'GPUs':>5} {'backends':>8} {'req/s':>7} {'wall s':>7} "
    f"{'sim req/wall s':>14} {'(best)':>7} {'sim req/CPU s':>13} {'real-time x':>11} "
    f"{'TTFT p95':>9} {'build':<8}"
)


def scaled_cluster(base: ClusterConfig, num_gpus: int) -> ClusterConfig:
    """``base`` with every count scaled so the total is ``num_gpus`` (base is 1,024)."""
    factor = num_gpus / sum(b.tp * b.count for b in base.backends)
    data = base.model_dump()
    for backend in data["backends"]:
        backend["count"] = max(1, math.floor(backend["count"] * factor))
    data["name"] = f"{base.name}-{num_gpus}"
    return parse_cluster_config(data)


def run_one(
    cluster: ClusterConfig, load: str, num_requests: int, policy: str, trace: str = "azure-conv"
) -> dict[str, float]:
    from kiloserve.sim import simulate  # after select_build (main)
    from kiloserve.workload import load_workload

    num_gpus = sum(b.tp * b.count for b in cluster.backends)
    rate = LOADS_PER_GPU[load] * num_gpus
    workload = load_workload(trace, rate=rate, num_requests=num_requests,
                             with_prompts=False)  # fmt: skip
    summary = simulate(cluster, workload, policy).summary
    wall_s, cpu_s = float(summary["sim_wall_s"]), float(summary["sim_cpu_s"])
    return {
        "gpus": num_gpus,
        "backends": sum(b.count for b in cluster.backends),
        "rate": rate,
        "requests": float(summary["simulated_requests"]),
        "wall_s": wall_s,
        "per_wall_s": float(summary["simulated_requests"]) / wall_s,
        "per_cpu_s": float(summary["simulated_requests"]) / cpu_s,
        "rtf": float(summary["real_time_factor"]),
        "ttft_p95_ms": float(summary["ttft_ms"]["p95"]),
    }


def run_repeated(
    cluster: ClusterConfig, load: str, num_requests: int, policy: str, repeat: int, trace: str
) -> dict[str, float]:
    """``run_one`` ``repeat`` times: medians, plus the best wall-clock rate."""
    runs = [run_one(cluster, load, num_requests, policy, trace) for _ in range(max(1, repeat))]
    out = dict(runs[0])
    for key in ("wall_s", "per_wall_s", "per_cpu_s", "rtf"):
        out[key] = statistics.median(r[key] for r in runs)
    out["best_per_wall_s"] = max(r["per_wall_s"] for r in runs)
    return out


def print_profile(
    cluster: ClusterConfig, load: str, num_requests: int, policy: str, trace: str, top: int
) -> None:
    """One more ``run_one`` under cProfile: its ``top`` functions by own time."""
    profile = cProfile.Profile()
    profile.runcall(run_one, cluster, load, num_requests, policy, trace)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


def run_day(policy: str, day_s: float = 86_400.0) -> int:
    """One simulated day at 1,024 GPUs and the reference rate (module docstring);
    ``day_s`` shortens it for a quick check (no verdict then)."""
    from kiloserve.sim import simulate  # after select_build (main)
    from kiloserve.workload import load_workload

    started = time.perf_counter()
    cluster = load_cluster_config(ROOT / "examples" / "cluster-1024.yaml")
    rate = SEED_REQUESTS_PER_DAY_1024 / 86_400
    workload = load_workload("azure-conv:repeat=inf", rate=rate, duration_s=day_s,
                             with_prompts=False)  # fmt: skip
    summary = simulate(cluster, workload, policy).summary
    total_s = time.perf_counter() - started
    n, loop_s = float(summary["simulated_requests"]), float(summary["sim_wall_s"])
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
    build = which_build()
    print(f"one simulated day: 1,024 GPUs, azure-conv:repeat=inf at {rate:.1f} req/s for "
          f"{day_s:,.0f} s, policy {policy}, {build} build")  # fmt: skip
    print(f"  {n:,.0f} requests ({summary['requests_ok']:,} ok), TTFT p95 "
          f"{float(summary['ttft_ms']['p95']):.0f} ms")  # fmt: skip
    print(f"  event loop {loop_s:.0f} s wall, {float(summary['sim_cpu_s']):.0f} s CPU: "
          f"{n / loop_s:,.0f} simulated req/wall s; whole run {total_s:.0f} s "
          f"({total_s / 60:.1f} min), peak RSS {peak_gb:.2f} GB")  # fmt: skip
    if day_s != 86_400.0:
        print("  (a shortened day: no verdict)")
        return 0
    met = "MET" if total_s < 600 else "NOT MET"
    print(f"target: one simulated day of 6.2 M requests in under 10 minutes ({build} build): "
          f"{total_s / 60:.1f} min -> {met}")  # fmt: skip
    return 0


def which_build() -> str:
    """``compiled`` when the simulator runs from a C extension (mypyc), else ``pure``."""
    return loaded_build()


def run_builds(args: argparse.Namespace) -> int:
    """``--compiled`` / ``--both``: this script once per build, each in its own process."""
    if subprocess.run([sys.executable, str(ROOT / "scripts" / "build_compiled.py")]).returncode:
        return 2
    forwarded = [f"--policy={args.policy}",
                 f"--sizes={args.sizes}", f"--loads={args.loads}",
                 f"--repeat={args.repeat}", f"--workloads={args.workloads}",
                 f"--profile={args.profile}"]  # fmt: skip
    if args.num_requests is not None:
        forwarded.append(f"--num-requests={args.num_requests}")
    if args.day:
        forwarded += ["--day", f"--day-seconds={args.day_seconds}"]
    rows: dict[str, list[dict[str, float | str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for build in ("pure", "compiled") if args.both else ("compiled",):
            env = {**os.environ, "KILOSERVE_SIM_BUILD": build}
            out = Path(tmp) / f"{build}.json"
            cmd = [sys.executable, __file__, *forwarded, f"--json-out={out}"]
            if subprocess.run(cmd, env=env).returncode:
                return 1
            if args.day:
                continue  # the day run prints its own lines
            rows[build] = json.loads(out.read_text())
            if {r["build"] for r in rows[build]} != {build}:
                raise SystemExit(f"the {build} run did not import the {build} build")
    if args.both and not args.day:
        print("compiled/pure (sim req/wall s):")
        for pure, comp in zip(rows["pure"], rows["compiled"], strict=True):
            ratio = float(comp["per_wall_s"]) / float(pure["per_wall_s"])
            print(f"  {pure['workload']:<10} {pure['load']:<5} {pure['gpus']:>5.0f} GPUs: "
                  f"{pure['per_wall_s']:.0f} "
                  f"(pure) -> {comp['per_wall_s']:.0f} (compiled): {ratio:.2f}x "
                  f"(medians)")  # fmt: skip
        for pure, comp in zip(rows["pure"], rows["compiled"], strict=True):
            if pure["size"] == 1024:
                target = TARGETS_PER_WALL_S[str(pure["workload"])]
                verdicts = [f"{r['build']} {r['per_wall_s']:.0f} (best {r['best_per_wall_s']:.0f})"
                    " -> " + ("MET" if float(r["per_wall_s"]) >= target else "NOT MET")
                    for r in (pure, comp)]  # fmt: skip
                print(f"target >= {target} simulated req/wall s at 1,024 GPUs "
                      f"({pure['workload']}, {pure['load']} load): "
                      f"{'; '.join(verdicts)}")  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (azure-conv 20,000; mooncake 3,000)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=3, help="runs per configuration")
    p.add_argument("--policy", default="round_robin", help="routing policy")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="GPU counts")
    p.add_argument("--loads", default="seed,busy", help="operating points: seed,busy")
    p.add_argument("--workloads", default="azure-conv,mooncake", help="traces to replay")
    p.add_argument("--compiled", action="store_true", help="use the mypyc build (built if stale)")
    p.add_argument("--both", action="store_true", help="pure and compiled, and their ratio")
    p.add_argument("--day", action="store_true", help="one literal simulated day (10-20 min)")
    p.add_argument("--day-seconds", type=float, default=86_400.0,
                   help="simulated seconds for --day (shorter: a quick check)")  # fmt: skip
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile each configuration: its N costliest functions")  # fmt: skip
    p.add_argument("--json-out", type=Path, help=argparse.SUPPRESS)  # rows, for run_builds
    args = p.parse_args()
    if args.compiled or args.both:
        return run_builds(args)
    print(select_build())
    if args.day:
        return run_day(args.policy, args.day_seconds)
    build = which_build()
    base = load_cluster_config(ROOT / "examples" / "cluster-1024.yaml")
    counts = {t: args.num_requests or DEFAULT_REQUESTS.get(t, 20_000)
              for t in args.workloads.split(",")}  # fmt: skip
    print(f"policy {args.policy}, requests per run {counts}, "
          f"{args.repeat} runs each (median; best wall rate in brackets)")  # fmt: skip
    print(HEADER)
    results = {}
    for trace in args.workloads.split(","):
        for load in args.loads.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                cluster = scaled_cluster(base, size)
                r = run_repeated(cluster, load, counts[trace], args.policy, args.repeat,
                                 trace)  # fmt: skip
                results[(trace, load, size)] = r
                print(f"{trace:<10} " + row_text(load, r, build))
                if args.profile > 0:
                    print_profile(cluster, load, counts[trace], args.policy, trace,
                                  args.profile)  # fmt: skip
    for (trace, load, size), r in results.items():
        if size == 1024:
            target = TARGETS_PER_WALL_S[trace]
            met = "MET" if r["per_wall_s"] >= target else "NOT MET"
            print(f"target >= {target} simulated req/wall s at 1,024 GPUs "
                  f"({trace}, {load} load, {build} build): median {r['per_wall_s']:.0f} "
                  f"(best {r['best_per_wall_s']:.0f}) -> {met}")  # fmt: skip
    if args.json_out is not None:
        rows = [{"workload": trace, "load": load, "size": size, "build": build, **r}
                for (trace, load, size), r in results.items()]  # fmt: skip
        args.json_out.write_text(json.dumps(rows))
    return 0


def row_text(load: str, r: dict[str, float], build: str) -> str:
    """One table row (after the workload column)."""
    return (f"{load:<5} {r['gpus']:>5.0f} {r['backends']:>8.0f} {r['rate']:>7.1f} "
            f"{r['wall_s']:>7.1f} {r['per_wall_s']:>14.0f} {r['best_per_wall_s']:>7.0f} "
            f"{r['per_cpu_s']:>13.0f} {r['rtf']:>11.2f} {r['ttft_p95_ms']:>7.0f}ms "
            f"{build:<8}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
