"""Soak: hold N concurrent streams through the gateway for D minutes under rotating faults.

    .venv/bin/python benchmarks/soak.py [--streams 1000] [--minutes 30] [--fault-every-s 180]
    .venv/bin/python benchmarks/soak.py --quick       # 2 minutes, 50 streams, faults every 15 s

Three H100 twins serving Llama-3.1-8B behind one gateway, started by the chaos drill
environment (``kiloserve.chaos.env.DrillEnv``, the drill gateway options: 1 s probes, 2 s
first-byte deadline, demotion on small windows). ``--streams`` closed-loop workers send
streaming completions back to back (``kiloserve.chaos.load.LoadGenerator``), so that many
streams are open at once for the whole run. Every ``--fault-every-s`` the next fault of
the rotation hits the next backend for half that period (at most 30 s), then is cleared:
kill (SIGKILL, restarted after the window), hang, stall (after 5 tokens), errors (50%
500s), slow (4x) and thermal (a fast-heating twin thermal fault, 4x clock drop).

Every ``--report-every-s`` (30 s) it prints the gateway's RSS (``VmRSS`` of the gateway
process and any children, ``/proc/PID/status``), its open file descriptors
(``/proc/PID/fd``), the latency of ``GET /health`` probed twice a second from a separate
client thread (a proxy for the gateway's event-loop lag: the gateway exports no lag
metric; the figure also includes the client box's own scheduling delay), requests done,
P95 TTFT and user-visible failures (a stream that failed, was cut or ended without
``[DONE]``).

Targets (printed met / NOT met): RSS growth from the end of warm-up to the end <= 5%;
user-visible failures = 0. Warm-up ends at the first report, or, with a policy that
keeps the approximate prefix index (``default``), at the first report that finds the
index at its cap (``kiloserve_prefix_index_blocks`` = ``..._max_blocks``, read from
``/metrics``): until then the bounded index is still filling (about 25 MiB at the
default 174,000-block cap; random prompts of ~6 blocks fill it in about 4-5 minutes at
100 requests/s), which is growth but no leak. A run that ends before the
index is full is judged from the first report, with the index still filling in it (a
note says so); growth from the first report is printed either way.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kiloserve.chaos.env import DrillEnv  # noqa: E402
from kiloserve.chaos.load import LoadGenerator, RequestResult  # noqa: E402
from kiloserve.chaos.report import Timeline, p95  # noqa: E402
from kiloserve.chaos.scenarios import SCENARIOS, DrillOptions  # noqa: E402
from kiloserve.launch.config import parse_cluster_config  # noqa: E402
from kiloserve.routing.engine_metrics import parse_samples  # noqa: E402

CLUSTER: dict[str, Any] = {
    "name": "soak",
    # one gateway process: the soak reads the RSS of the gateway's pid
    "gateway": {"port": 0, "policy": "default", "options": {"workers": 1}},
    "backends": [{"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 3}],
}
ROTATION = ("kill", "hang", "stall", "errors", "slow", "thermal")
THERMAL = {
    "throttle_at_c": 60.0, "resume_at_c": 55.0, "factor": 4.0, "ambient_c": 40.0,
    "load_c": 90.0, "time_constant_s": 1.0,
}  # fmt: skip
MAX_FAULT_S = 30.0
RSS_GROWTH_TARGET = 0.05
HEALTH_PROBE_EVERY_S = 0.5


@dataclass(slots=True)
class Sample:
    t_s: float
    rss_mib: float
    fds: int
    health_p50_ms: float | None
    health_max_ms: float | None
    done: int
    failures: int
    ttft_p95_ms: float | None
    fault: str
    prefix_blocks: int | None = None  # the policy's approximate prefix index, if it keeps one
    prefix_max_blocks: int | None = None


@dataclass(slots=True)
class SoakState:
    fault: str = "-"
    faults_done: list[str] = field(default_factory=list)


def _descendants(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                text = Path(f"/proc/{p}/task/{task}/children").read_text()
                todo.extend(int(c) for c in text.split())
        except OSError:
            continue
    return pids


def rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` and its descendants, in MiB."""
    total_kib = 0
    for p in _descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / 1024.0


def open_fds(pid: int) -> int:
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in _descendants(pid))


class HealthProbe(threading.Thread):
    """``GET /health`` every ``HEALTH_PROBE_EVERY_S`` from its own thread (not the load's
    event loop); records (time, latency ms), a timeout or error as ``inf``."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="health-probe")
        self.url = url + "/health"
        self.samples: list[tuple[float, float]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(HEALTH_PROBE_EVERY_S):
            start = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5.0) as resp:
                    resp.read()
                ms = (time.monotonic() - start) * 1000.0
            except OSError:
                ms = float("inf")
            self.samples.append((start, ms))


async def _thermal(env: DrillEnv, victim: str, o: DrillOptions, t: Timeline) -> None:
    t.hits_s.append(time.monotonic())
    await env.faults(victim, {"thermal": THERMAL})
    await asyncio.sleep(o.fault_s)
    await env.faults(victim, {})
    t.clear_s = time.monotonic()


async def _faults(
    env: DrillEnv, state: SoakState, every_s: float, start_s: float, end_s: float
) -> None:
    """The fault rotation: one fault per period, each on the next backend."""
    names = env.names()
    opts = DrillOptions(fault_s=min(MAX_FAULT_S, every_s / 2))
    i = 0
    while True:
        at_s = start_s + (i + 1) * every_s
        if at_s + opts.fault_s > end_s:
            return
        await asyncio.sleep(max(0.0, at_s - time.monotonic()))
        kind, victim = ROTATION[i % len(ROTATION)], names[i % len(names)]
        state.fault = f"{kind}@{victim}"
        timeline = Timeline(start_s=time.monotonic())
        if kind == "thermal":
            await _thermal(env, victim, opts, timeline)
        else:
            await SCENARIOS[kind].fault(env, victim, opts, timeline)
        state.faults_done.append(state.fault)
        state.fault = "-"
        i += 1


PREFIX_GAUGES = ("kiloserve_prefix_index_blocks", "kiloserve_prefix_index_max_blocks")


async def prefix_index_fill(env: DrillEnv) -> tuple[int | None, int | None]:
    """(blocks, cap) of the gateway policy's prefix index from ``/metrics``; Nones when
    it keeps none or ``/metrics`` did not answer."""
    try:
        text = await env.metrics_text()
    except (OSError, TimeoutError, aiohttp.ClientError):
        return None, None
    values = {name: int(v) for name, _, v in parse_samples(text) if name in PREFIX_GAUGES}
    return values.get(PREFIX_GAUGES[0]), values.get(PREFIX_GAUGES[1])


def _failed(r: RequestResult) -> bool:
    return r.end_s > 0 and not r.is_ok


async def soak(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cluster = {**CLUSTER, "gateway": {**CLUSTER["gateway"], "policy": args.policy}}
    env = DrillEnv(parse_cluster_config(cluster), run_dir)
    await asyncio.to_thread(env.start)
    assert env.gateway is not None and env.gateway.pid is not None
    pid = env.gateway.pid
    probe = HealthProbe(env.gateway_url)
    load = LoadGenerator(env.gateway_url, env.cluster.backends[0].model, args.streams,
                         max_tokens=args.max_tokens)  # fmt: skip
    state = SoakState()
    samples: list[Sample] = []
    duration_s = args.minutes * 60.0
    try:
        probe.start()
        await load.start()
        start_s = time.monotonic()
        end_s = start_s + duration_s
        fault_task = asyncio.create_task(_faults(env, state, args.fault_every_s, start_s, end_s))
        last_done = 0
        while time.monotonic() < end_s - 1e-3:
            await asyncio.sleep(min(args.report_every_s, end_s - time.monotonic()))
            now_s = time.monotonic()
            window_from = now_s - args.report_every_s
            lat = [ms for at, ms in probe.samples if at >= window_from]
            done = [r for r in load.results if r.end_s > 0]
            recent = [r.ttft_ms for r in done[last_done:] if r.ttft_ms is not None]
            last_done = len(done)
            prefix_blocks, prefix_max_blocks = await prefix_index_fill(env)
            s = Sample(
                t_s=now_s - start_s,
                rss_mib=rss_mib(pid),
                fds=open_fds(pid),
                health_p50_ms=statistics.median(lat) if lat else None,
                health_max_ms=max(lat) if lat else None,
                done=len(done),
                failures=sum(1 for r in done if _failed(r)),
                ttft_p95_ms=p95(recent),
                fault=state.fault,
                prefix_blocks=prefix_blocks,
                prefix_max_blocks=prefix_max_blocks,
            )
            samples.append(s)
            print(_line(s), flush=True)
        await fault_task
    finally:
        await load.stop()
        probe.stop_event.set()
        await env.close()
        await asyncio.to_thread(env.stop)
    done = [r for r in load.results if r.end_s > 0]
    reasons: dict[str, int] = {}
    for r in done:
        if _failed(r):
            reasons[r.reason or "unknown"] = reasons.get(r.reason or "unknown", 0) + 1
    lat_all = sorted(ms for _, ms in probe.samples)
    return {
        "streams": args.streams,
        "minutes": args.minutes,
        "fault_every_s": args.fault_every_s,
        "policy": args.policy,
        "samples": [dataclasses.asdict(s) for s in samples],
        "faults": state.faults_done,
        "requests": len(done),
        "user_visible_failures": sum(reasons.values()),
        "failure_reasons": reasons,
        "health_p50_ms": statistics.median(lat_all) if lat_all else None,
        "health_p99_ms": lat_all[int(0.99 * (len(lat_all) - 1))] if lat_all else None,
        "health_max_ms": lat_all[-1] if lat_all else None,
    }


def _ms(v: float | None) -> str:
    return "   -" if v is None else f"{v:6.1f}" if v != float("inf") else "  timeout"


def _line(s: Sample) -> str:
    prefix = ""
    if s.prefix_blocks is not None and s.prefix_max_blocks is not None:
        prefix = f"  prefix_index={s.prefix_blocks / 1000:.0f}k/{s.prefix_max_blocks / 1000:.0f}k"
    return (
        f"  t={s.t_s:6.0f}s  rss={s.rss_mib:7.1f} MiB  fds={s.fds:5d}  "
        f"/health p50={_ms(s.health_p50_ms)} max={_ms(s.health_max_ms)} ms  "
        f"done={s.done:6d}  ttft_p95={_ms(s.ttft_p95_ms)} ms  failures={s.failures}{prefix}  "
        f"fault={s.fault}"
    )


def _index_full(s: dict[str, Any]) -> bool:
    blocks, cap = s.get("prefix_blocks"), s.get("prefix_max_blocks")
    return blocks is not None and cap is not None and blocks >= cap


def warm_sample(samples: list[dict[str, Any]]) -> tuple[int, str]:
    """The index of the sample that ends warm-up, and a note on how it was chosen: the
    first, or with a prefix index the first that finds it at its cap (the first again,
    noted, when none before the last does)."""
    if samples[0].get("prefix_max_blocks") is None:
        return 0, ""
    full = next((i for i, s in enumerate(samples[:-1]) if _index_full(s)), None)
    if full is None:
        last = samples[-1]
        return 0, (
            f" [the prefix index was still filling ({last['prefix_blocks']:,} of "
            f"{last['prefix_max_blocks']:,} blocks at the end): this growth includes it; "
            f"run longer for the figure after it is full]"
        )
    return full, ", the prefix index at its cap" if full > 0 else ""


def verdict(result: dict[str, Any]) -> tuple[list[str], bool]:
    """The summary lines against the targets, and whether every target was met."""
    samples = result["samples"]
    lines, ok = [], True
    if len(samples) >= 2:
        warm, note = warm_sample(samples)
        base, last, first = samples[warm], samples[-1], samples[0]
        peak = max(s["rss_mib"] for s in samples[warm + 1 :])
        growth = last["rss_mib"] / base["rss_mib"] - 1.0
        met = growth <= RSS_GROWTH_TARGET
        ok &= met
        lines.append(
            f"gateway RSS: {base['rss_mib']:.1f} MiB after warm-up (t={base['t_s']:.0f} s"
            f"{note if warm else ''}), {last['rss_mib']:.1f} MiB at the end (peak {peak:.1f}): "
            f"growth {growth:+.1%} (target <= {RSS_GROWTH_TARGET:.0%}): "
            f"{'met' if met else 'NOT met'}{'' if warm else note}"
        )
        if warm:
            from_first = last["rss_mib"] / first["rss_mib"] - 1.0
            lines.append(
                f"gateway RSS from the first report (t={first['t_s']:.0f} s, "
                f"{first['rss_mib']:.1f} MiB), the prefix index filling in it: "
                f"{from_first:+.1%} (reported)"
            )
        lines.append(
            f"gateway open fds: {base['fds']} after warm-up, {last['fds']} at the end, "
            f"max {max(s['fds'] for s in samples)} (no target; reported)"
        )
    else:
        ok = False
        lines.append("gateway RSS: fewer than two samples (run longer): NOT met")
    failures = result["user_visible_failures"]
    met = failures == 0
    ok &= met
    lines.append(
        f"user-visible failures: {failures} of {result['requests']} requests (target 0): "
        f"{'met' if met else 'NOT met'} {result['failure_reasons'] or ''}".rstrip()
    )
    lines.append(
        f"/health latency (event-loop lag proxy, client thread): p50 "
        f"{_ms(result['health_p50_ms']).strip()} ms, p99 {_ms(result['health_p99_ms']).strip()}"
        f" ms, max {_ms(result['health_max_ms']).strip()} ms (no target; reported)"
    )
    lines.append(f"faults injected ({len(result['faults'])}): {', '.join(result['faults'])}")
    return lines, ok


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--streams", type=int, help="concurrent streams (default 1000; --quick 50)")
    ap.add_argument("--minutes", type=float, help="duration (default 30; --quick 2)")
    ap.add_argument("--fault-every-s", type=float, help="fault period (default 180; --quick 15)")
    ap.add_argument("--report-every-s", type=float, default=30.0, help="report period (30)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max tokens per request (64)")
    ap.add_argument("--policy", default="default", help="gateway routing policy (default)")
    ap.add_argument("--quick", action="store_true", help="the 2-minute version")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args()
    quick = args.quick
    args.streams = args.streams or (50 if quick else 1000)
    args.minutes = args.minutes or (2.0 if quick else 30.0)
    args.fault_every_s = args.fault_every_s or (15.0 if quick else 180.0)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"soak: {args.streams} streams for {args.minutes:g} min, a fault every "
        f"{args.fault_every_s:g} s ({' -> '.join(ROTATION)}), 3 H100 twins + gateway "
        f"(policy {args.policy}), {os.cpu_count()} CPUs, {now}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kiloserve-soak-") as tmp:
        result = asyncio.run(soak(args, Path(tmp)))
    lines, ok = verdict(result)
    for line in lines:
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "all_targets_met": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
