"""Flow control on vs off on a twin cluster overloaded at 1.5x its capacity (issue 8).

    .venv/bin/python benchmarks/flow_control.py [--duration 60] [--overload 1.5]

Two A10 twins serving Qwen2.5-7B (about 42k KV tokens each, so KV memory is the
bottleneck) take a mix of short prompts (< 128 tokens) and decode-heavy requests
(~1100-token prompts, ~600 output tokens), half each.
First a light probe estimates the cluster's KV-bound capacity (probe rate / KV
fraction used); then the same open-loop arrivals at ``--overload`` x that rate go through
a fresh cluster twice: admission off (today's gateway) and on (gateway queue, lanes,
KV budget). A sampler reads every engine's ``/metrics`` while requests arrive.

Targets: short-request P95 TTFT on <= 0.5x off; goodput under the SLO on >= 1.3x
off; mean KV usage on >= 85% with preemptions/request on <= 0.5x off; every request
ends (a response or a 429/503) within its deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kiloserve.bench.client import ClientOptions, run_bench  # noqa: E402
from kiloserve.launch.cluster import LocalCluster  # noqa: E402
from kiloserve.launch.config import ClusterConfig  # noqa: E402
from kiloserve.results.records import RequestRecord  # noqa: E402
from kiloserve.routing.engine_metrics import parse_engine_metrics  # noqa: E402
from kiloserve.workload import OpenLoop, load_workload  # noqa: E402
from kiloserve.workload.request import RequestSpec, Workload  # noqa: E402

MODEL = "Qwen2-7B"  # the catalog name of qwen2.5-7b, served as such by the twins
SHORT = "synthetic:input=uniform(16,127),output=uniform(10,50)"
LONG = "synthetic:input=lognormal(1200,0.5),output=lognormal(600,0.5)"  # decode-heavy: KV-bound
GPU, CATALOG_MODEL, KV_TOKENS = "A10", "qwen2.5-7b", 42032
KV_BYTES_PER_TOKEN = 57344  # the catalog's figure for qwen2.5-7b in bf16 (memory ledger)
SHORT_MAX_TOKENS = 128
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.15


def mixed_workload(seed: int, rate: float | None, duration_s: float | None) -> Workload:
    """Half short prompts, half long decode-heavy requests, merged by arrival time."""
    half = None if rate is None else rate / 2
    num = None if duration_s is not None else 2_000
    parts = [
        (name, load_workload(spec, seed=seed + i, rate=half, duration_s=duration_s,
                             num_requests=num))
        for i, (name, spec) in enumerate((("short", SHORT), ("long", LONG)))
    ]  # fmt: skip

    def make_iter() -> Iterator[RequestSpec]:
        tagged = [r.replaced(request_id=f"{name}-{r.request_id}") for name, wl in parts for r in wl]
        if rate is None:  # closed loop: alternate
            tagged.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[-1]))
        else:
            tagged.sort(key=lambda r: r.arrival_s or 0.0)
        return iter(tagged)

    total = sum(wl.num_requests or 0 for _, wl in parts)
    return Workload(
        "flow-mix", seed, make_iter, num_requests=total, params={"short": SHORT, "long": LONG}
    )


def cluster_config(num_backends: int) -> ClusterConfig:
    backends = [
        {"name": f"a10-{i}", "gpu": GPU, "model": CATALOG_MODEL} for i in range(num_backends)
    ]
    return ClusterConfig.model_validate(
        {"name": "flow", "gateway": {"port": 0, "policy": "default"}, "backends": backends}
    )


def admission_options(on: bool, args: argparse.Namespace) -> dict[str, Any]:
    # one gateway process (--workers 1): how the figures in docs were measured
    if not on:
        return {"seed": args.seed, "workers": 1}
    capacity = {
        "default_kv_capacity_tokens": KV_TOKENS,
        "kv_bytes_per_token": {MODEL: KV_BYTES_PER_TOKEN},
        "kv_budget_frac": args.kv_budget_frac,
        "kv_estimate": args.kv_estimate,
        "decode_growth_frac": args.decode_growth_frac,
        "short_extra_budget_frac": args.short_extra_budget_frac,
        "max_in_flight_per_backend": 256,
        "reduced_max_in_flight": 64,
    }
    admission = {
        "enabled": True,
        "max_queue_len": 512,
        "max_queue_wait_s": args.max_queue_wait_s,
        "short_max_tokens": SHORT_MAX_TOKENS,
        "window_s": args.window_s,
        "capacity": capacity,
    }
    return {"seed": args.seed, "workers": 1, "admission": admission}


class Sampler:
    """Reads every engine's KV usage and preemptions while the run is going."""

    def __init__(self, urls: list[str], interval_s: float = 0.25) -> None:
        self.urls = urls
        self.interval_s = interval_s
        self.kv: list[float] = []
        self.preemptions: dict[str, int] = {}

    async def read(self, s: aiohttp.ClientSession, url: str) -> tuple[float | None, int]:
        async with s.get(url + "/metrics") as r:
            m = parse_engine_metrics(await r.text())
        return m.kv_usage, int(m.num_preemptions or 0)

    async def preemptions_total(self) -> int:
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(self.read(s, u) for u in self.urls))
        return sum(p for _, p in got)

    async def run(self, until: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as s:
            while not until.is_set():
                got = await asyncio.gather(*(self.read(s, u) for u in self.urls))
                self.kv.append(float(np.mean([k or 0.0 for k, _ in got])))
                await asyncio.sleep(self.interval_s)


async def measured_run(url: str, engine_urls: list[str], workload: Any, arrival: Any,
                       sample_until_s: float, warmup_s: float) -> dict[str, Any]:  # fmt: skip
    sampler = Sampler(engine_urls)
    before = await sampler.preemptions_total()
    stop = asyncio.Event()

    async def sample_after_warmup() -> None:
        await asyncio.sleep(warmup_s)
        await sampler.run(stop)

    task = asyncio.create_task(sample_after_warmup())
    opts = ClientOptions(timeout_s=600)
    bench = asyncio.create_task(run_bench(url, MODEL, workload, arrival, options=opts))
    await asyncio.sleep(max(warmup_s + 1.0, sample_until_s))
    stop.set()
    await task
    result = await bench
    after = await sampler.preemptions_total()
    return {"result": result, "kv": sampler.kv, "preemptions": after - before}


def start_cluster(args: argparse.Namespace, on: bool, tag: str) -> LocalCluster:
    run_dir = args.out / tag
    run_dir.mkdir(parents=True, exist_ok=True)
    return LocalCluster(cluster_config(args.num_backends), gateway=True, gateway_port=0,
                        run_dir=run_dir, gateway_options=admission_options(on, args))  # fmt: skip


def probe_capacity(args: argparse.Namespace) -> float:
    """KV-bound capacity: a light open-loop run (flow control off) at ``--probe-rate``
    uses a fraction ``u`` of the KV cache; capacity ~= probe rate / u. (A closed-loop
    probe measures the preemption-thrashing throughput instead, well below this.)"""
    wl = mixed_workload(args.seed + 1, args.probe_rate, args.probe_s)
    with start_cluster(args, False, "probe") as c:
        assert c.gateway_url is not None
        urls = [b.url for b in c.backends]
        run = asyncio.run(
            measured_run(c.gateway_url, urls, wl, OpenLoop(None), args.probe_s, args.warmup)
        )
    usage = float(np.mean(run["kv"])) if run["kv"] else 0.0
    if usage <= 0.05:
        raise SystemExit(f"probe used {usage:.0%} of KV: raise --probe-rate")
    print(f"probe: {args.probe_rate} req/s used {usage:.1%} of KV", flush=True)
    return float(args.probe_rate / usage)


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(run: dict[str, Any], duration_s: float, max_wait_s: float) -> dict[str, Any]:
    records: list[RequestRecord] = run["result"].records
    short = [
        r.ttft_s for r in records if r.input_tokens < SHORT_MAX_TOKENS and r.is_ok and r.ttft_s
    ]
    good = [r for r in records if r.is_ok and r.ttft_s is not None and r.ttft_s <= SLO_TTFT_S
            and (r.tpot_s is None or r.tpot_s <= SLO_TPOT_S)]  # fmt: skip
    statuses: dict[str, int] = {}
    for r in records:
        key = str(r.status) if r.status is not None else ("timeout" if r.is_timeout else "none")
        statuses[key] = statuses.get(key, 0) + 1
    unended = [r for r in records if r.status is None]
    slow_rejects = [
        r for r in records if r.status in (429, 503) and (r.e2e_s or 0) > max_wait_s + 5
    ]
    return {
        "num_requests": len(records),
        "statuses": statuses,
        "short_p95_ttft_s": _p(short, 95),
        "short_p50_ttft_s": _p(short, 50),
        "num_short_ok": len(short),
        "goodput_rps": len(good) / duration_s,
        "mean_kv_usage": float(np.mean(run["kv"])) if run["kv"] else float("nan"),
        "preemptions": run["preemptions"],
        "preemptions_per_request": run["preemptions"] / max(1, len(records)),
        "num_rejected": sum(1 for r in records if r.status in (429, 503)),
        "num_rejected_short": sum(
            1 for r in records if r.status in (429, 503) and r.input_tokens < SHORT_MAX_TOKENS
        ),
        "max_reject_s": max((r.e2e_s or 0.0 for r in records if r.status in (429, 503)), default=0),
        "num_unended": len(unended),
        "num_late_rejects": len(slow_rejects),
    }


def one_mode(args: argparse.Namespace, on: bool, rate: float) -> dict[str, Any]:
    wl = mixed_workload(args.seed, rate, args.duration)
    tag = "on" if on else "off"
    with start_cluster(args, on, tag) as c:
        assert c.gateway_url is not None
        urls = [b.url for b in c.backends]
        t0 = time.monotonic()
        run = asyncio.run(
            measured_run(c.gateway_url, urls, wl, OpenLoop(None), args.duration, args.warmup)
        )
        wall_s = time.monotonic() - t0
    out = summarize(run, args.duration, args.max_queue_wait_s)
    out["wall_s"] = wall_s
    return out


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(off: dict[str, Any], on: dict[str, Any], rate: float, capacity: float) -> None:
    print(f"\ncapacity {capacity:.2f} req/s, offered {rate:.2f} req/s")
    for name, s in (("off", off), ("on", on)):
        print(f"[{name}] {json.dumps(s)}")
    r_ttft = on["short_p95_ttft_s"] / off["short_p95_ttft_s"]
    r_good = on["goodput_rps"] / max(1e-9, off["goodput_rps"])
    r_pre = on["preemptions_per_request"] / max(1e-9, off["preemptions_per_request"])
    ended = on["num_unended"] == 0 and on["num_late_rejects"] == 0
    print("\n## Targets (issue 8)")
    print(
        f"short P95 TTFT on/off        = {r_ttft:.2f}  (target <= 0.50: {verdict(r_ttft <= 0.5)})"
    )
    print(f"goodput (SLO TTFT<={SLO_TTFT_S}s, TPOT<={SLO_TPOT_S}s) on/off = {r_good:.2f}  "
          f"(target >= 1.30: {verdict(r_good >= 1.3)})")  # fmt: skip
    kv_on, kv_off = on["mean_kv_usage"], off["mean_kv_usage"]
    print(f"mean KV usage on             = {kv_on:.1%}  "
          f"(target >= 85%: {verdict(kv_on >= 0.85)}; off {kv_off:.1%})")  # fmt: skip
    pre_on, pre_off = on["preemptions_per_request"], off["preemptions_per_request"]
    print(f"preemptions/request on/off   = {r_pre:.2f}  (target <= 0.50: {verdict(r_pre <= 0.5)})"
          f"  [{pre_on:.3f} vs {pre_off:.3f}]")  # fmt: skip
    print(f"every request ended in time  = {ended}  (target: True: {verdict(ended)})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per mode")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before KV sampling")
    p.add_argument("--overload", type=float, default=1.5)
    p.add_argument("--capacity", type=float, default=None, help="skip the probe (req/s)")
    p.add_argument("--probe-s", type=float, default=40.0)
    p.add_argument("--probe-rate", type=float, default=3.8, help="req/s, under capacity")
    p.add_argument("--num-backends", type=int, default=2)
    p.add_argument("--kv-budget-frac", type=float, default=0.97)
    p.add_argument("--kv-estimate", choices=["reserved", "scraped"], default="scraped")
    p.add_argument("--decode-growth-frac", type=float, default=0.1)
    p.add_argument("--short-extra-budget-frac", type=float, default=0.03)
    p.add_argument("--max-queue-wait-s", type=float, default=1.5)
    p.add_argument("--window-s", type=float, default=0.0, help="memory-budget window (S2.2)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--only", choices=["on", "off"], default=None)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "flow-control")
    args = p.parse_args()
    capacity = args.capacity if args.capacity is not None else probe_capacity(args)
    rate = capacity * args.overload
    print(f"capacity {capacity:.2f} req/s -> offered {rate:.2f} req/s", flush=True)
    results = {}
    for mode in ("off", "on"):
        if args.only in (None, mode):
            results[mode] = one_mode(args, mode == "on", rate)
            print(f"[{mode}] {json.dumps(results[mode])}", flush=True)
    if len(results) == 2:
        report(results["off"], results["on"], rate, capacity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
