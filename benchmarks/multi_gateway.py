"""Two gateways behind HAProxy vs one, with the shared in-flight view off and on.

    .venv/bin/python benchmarks/multi_gateway.py [--repeats 3] [--requests 200] [--rate 25]

The stack of ``tests/integration/test_multi_gateway.py`` (real processes on
127.0.0.1): three engine twins (slow-downs 4, 4 and 10, so routing matters), the
gateways (policy ``default``, scrape every 0.2 s) and Debian's ``haproxy`` with the
shipped config. Per repeat, on fresh twins each time (a warm prefix cache would favour
later runs), in this order: one gateway; two gateways that share nothing; two gateways
with ``peers: {enabled: true}`` through a ``redis-server`` started here. The same
workload every time (``synthetic:input=uniform(300,900),output=fixed(16)``, open loop,
fixed seed).

Printed per configuration: mean and P99 TTFT (means over the repeats) and the ratio to
one gateway's; routing distance to one gateway (total variation distance of the
per-backend request shares, mean over repeats). Targets (issue 16): two gateways with
the shared view within 5% of one gateway's mean and P99 TTFT, routing distance <= 0.05.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "integration")]

from test_multi_gateway import (  # noqa: E402
    WORKLOAD,
    _start_stack,
    _wait_all_backends_up,
    routing_distance,
    shares,
)

from conftest import free_port  # noqa: E402
from kiloserve.bench.client import run_bench  # noqa: E402
from kiloserve.results.metrics import summarize  # noqa: E402
from kiloserve.workload import OpenLoop, load_workload  # noqa: E402

MODEL = "Llama-3.1-8B"
CONFIGS = (("one", 1, False), ("two", 2, False), ("two+peers", 2, True))


def _redis() -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    return proc, f"redis://127.0.0.1:{port}/0"


async def _run(run_dir: Path, num: int, redis: str | None, args: argparse.Namespace) -> dict:
    stack = _start_stack(run_dir, num, redis)
    try:
        for gw in stack.gateways:
            await _wait_all_backends_up(gw.url)
        if redis is not None:
            await asyncio.sleep(1.5)  # the peers' first snapshots
        workload = load_workload(WORKLOAD, seed=11, num_requests=args.requests, rate=args.rate)
        return summarize(await run_bench(stack.url, MODEL, workload, OpenLoop()))
    finally:
        for child in reversed(stack.children):
            child.stop(grace_s=3.0)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=25.0)
    args = ap.parse_args()
    print(f"multi-gateway benchmark: {args.repeats} repeats x {len(CONFIGS)} configurations, "
          f"{args.requests} requests at {args.rate:g}/s each")  # fmt: skip
    redis_proc, redis_url = _redis()
    got: dict[str, list[dict]] = {name: [] for name, _, _ in CONFIGS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.repeats):
                for name, num, peers in CONFIGS:
                    run_dir = Path(tmp) / f"{name}-{rep}"
                    run_dir.mkdir()
                    s = asyncio.run(_run(run_dir, num, redis_url if peers else None, args))
                    ttft = s["ttft_ms"]
                    print(f"  repeat {rep} {name:<10} TTFT mean {ttft['mean']:7.1f} ms, "
                          f"P99 {ttft['p99']:7.1f} ms, failed {s['requests_failed']}, "
                          f"shares {({b: round(v, 2) for b, v in shares(s).items()})}",
                          flush=True)  # fmt: skip
                    got[name].append(s)
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
    one = got["one"]
    mean1 = statistics.mean(s["ttft_ms"]["mean"] for s in one)
    p991 = statistics.mean(s["ttft_ms"]["p99"] for s in one)
    print(f"\n{'config':<12}{'TTFT mean ms':>14}{'ratio':>8}{'TTFT P99 ms':>13}{'ratio':>8}"
          f"{'routing distance':>18}")  # fmt: skip
    for name, _, _ in CONFIGS:
        runs = got[name]
        mean = statistics.mean(s["ttft_ms"]["mean"] for s in runs)
        p99 = statistics.mean(s["ttft_ms"]["p99"] for s in runs)
        dist = statistics.mean(
            routing_distance(shares(a), shares(b)) for a, b in zip(one, runs, strict=True)
        )
        print(f"{name:<12}{mean:>14.1f}{mean / mean1:>8.2f}{p99:>13.1f}{p99 / p991:>8.2f}"
              f"{dist:>18.3f}")  # fmt: skip
        if name == "two+peers":
            ok_mean, ok_p99 = mean / mean1 <= 1.05, p99 / p991 <= 1.05
            print(f"\ntwo gateways with the shared view vs one: mean TTFT {mean / mean1:.2f}x "
                  f"(target <= 1.05: {'met' if ok_mean else 'NOT met'}), P99 {p99 / p991:.2f}x "
                  f"({'met' if ok_p99 else 'NOT met'}), routing distance {dist:.3f} "
                  f"(target <= 0.05: {'met' if dist <= 0.05 else 'NOT met'})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
