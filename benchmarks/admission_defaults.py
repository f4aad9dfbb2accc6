"""Admission with its defaults vs none, and the 100 ms window vs none (issue 17, S2.2/S2.3).

    .venv/bin/python benchmarks/admission_defaults.py --rate 12 --duration 40
    .venv/bin/python benchmarks/admission_defaults.py --variants defaults,window --rate 12

Two L40S twins serving Llama-3.1-8B take ``mix:chat=0.8,longdoc=0.2`` (chat: ~1000-token
prompts; longdoc: ~8000) as open-loop Poisson arrivals. Every variant gets the identical
arrivals on a fresh cluster (``kiloserve up``'s gateway, policy ``default``):

* ``off``: no admission (the baseline);
* ``defaults``: ``admission: {enabled: true}`` and nothing else;
* ``unbounded``: the defaults without the engine prefill bound
  (``max_queued_prefill_tokens: null``), i.e. admission as it was before issue 17;
* ``window``: the defaults plus ``window_s: 0.1`` (seed 000's memory-budget window).

Prints, per variant, chat ("short") P95 / P99 TTFT, all-request P99 TTFT, longdoc
completions per second, mean engine KV usage, answers, and each figure's ratio to the
first variant of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
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

MODEL, CATALOG_MODEL, GPU = "Llama-3.1-8B", "llama-3.1-8b", "L40S"
WORKLOAD = "mix:chat=0.8,longdoc=0.2"
VARIANTS: dict[str, dict[str, Any]] = {
    "off": {},
    "defaults": {"admission": {"enabled": True}},
    "unbounded": {"admission": {"enabled": True, "capacity": {"max_queued_prefill_tokens": None}}},
    "window": {"admission": {"enabled": True, "window_s": 0.1}},
}


async def sample_kv(urls: list[str], stop: asyncio.Event, out: list[float]) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            usage = []
            for url in urls:
                async with s.get(url + "/metrics") as r:
                    usage.append(parse_engine_metrics(await r.text()).kv_usage or 0.0)
            out.append(float(np.mean(usage)))
            await asyncio.sleep(0.25)


async def measured(url: str, urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    wl = load_workload(WORKLOAD, seed=args.seed, rate=args.rate, duration_s=args.duration)
    kv: list[float] = []
    stop = asyncio.Event()

    async def after_warmup() -> None:
        await asyncio.sleep(args.warmup)
        await sample_kv(urls, stop, kv)

    sampler = asyncio.create_task(after_warmup())
    bench = asyncio.create_task(
        run_bench(url, MODEL, wl, OpenLoop(None), options=ClientOptions(timeout_s=600))
    )
    await asyncio.sleep(args.duration)
    stop.set()
    await sampler
    result = await bench
    return {"records": result.records, "kv": kv}


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(run: dict[str, Any], duration_s: float) -> dict[str, Any]:
    records: list[RequestRecord] = run["records"]
    ok = [r for r in records if r.is_ok and r.ttft_s is not None]
    chat = [r.ttft_s for r in ok if r.request_id.startswith("chat") and r.ttft_s is not None]
    every = [r.ttft_s for r in ok if r.ttft_s is not None]
    docs = [r for r in ok if r.request_id.startswith("longdoc")]
    statuses: dict[str, int] = {}
    for r in records:
        key = str(r.status) if r.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "short_p95_ttft_s": _p(chat, 95),
        "short_p99_ttft_s": _p(chat, 99),
        "all_p99_ttft_s": _p(every, 99),
        "long_done_per_s": len(docs) / duration_s,
        "mean_kv_usage": float(np.mean(run["kv"])) if run["kv"] else float("nan"),
        "statuses": statuses,
    }


def one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    backends = [{"name": f"l40s-{i}", "gpu": GPU, "model": CATALOG_MODEL} for i in range(2)]
    cfg = ClusterConfig.model_validate(
        {"name": "adm", "gateway": {"port": 0, "policy": "default"}, "backends": backends}
    )
    run_dir = args.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    # one gateway process (--workers 1): how the figures in docs were measured
    options = {"seed": args.seed, "workers": 1, **VARIANTS[name]}
    with LocalCluster(
        cfg, gateway=True, gateway_port=0, run_dir=run_dir, gateway_options=options
    ) as c:
        assert c.gateway_url is not None
        t0 = time.monotonic()
        run = asyncio.run(measured(c.gateway_url, [b.url for b in c.backends], args))
        out = summarize(run, args.duration)
        out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def report(results: dict[str, dict[str, Any]]) -> None:
    base_name = next(iter(results))
    base = results[base_name]
    keys = ["short_p95_ttft_s", "short_p99_ttft_s", "all_p99_ttft_s", "long_done_per_s",
            "mean_kv_usage"]  # fmt: skip
    print(f"\n| figure | {' | '.join(results)} | ratios vs {base_name} |")
    print("|---|" + "---|" * (len(results) + 1))
    for k in keys:
        vals = " | ".join(f"{r[k]:.3f}" for r in results.values())
        ratios = ", ".join(
            f"{n} {r[k] / base[k]:.2f}x" for n, r in results.items() if n != base_name and base[k]
        )
        print(f"| {k} | {vals} | {ratios} |")
    print("| answers | " + " | ".join(json.dumps(r["statuses"]) for r in results.values()) + " | |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=12.0, help="req/s offered (both twins)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before KV sampling")
    p.add_argument("--variants", default="off,defaults", help=f"of {','.join(VARIANTS)}")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "admission-defaults")
    args = p.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for name in args.variants.split(","):
        results[name] = one(args, name)
        print(f"[{name}] {json.dumps(results[name])}", flush=True)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
