"""Multi-tenant shared prefixes on a live twin cluster: exact (KV events) vs approximate
prefix routing vs round robin.

    .venv/bin/python benchmarks/prefix_routing.py            # ~10.5 min: 100 tenants
    .venv/bin/python benchmarks/prefix_routing.py --quick    # ~4 min: 48 tenants

Cluster: 8 twins of one L40S serving Llama-3.1-8B (each holds ~193k tokens of KV, so
one backend holds 39% of the 100 tenants' prefixes, 80% of ``--quick``'s 48, and the
cluster holds them all),
started with the launcher (``LocalCluster``) on 127.0.0.1, gateway in front. Workload:
each tenant has a 4,000-6,000-token system prompt (identical text, so the twin
tokenises the head identically), each request is its tenant's prompt plus a short unique
user turn (32-128 tokens) and asks for 16-64 tokens; tenants are drawn uniformly,
Poisson arrivals at ``--load`` (0.75) of the cluster's cold capacity (every request
prefilling its whole prompt, from the twin's step-time model; printed). Three runs, each
on a freshly started cluster (empty caches), the identical request sequence:

* ``default`` with KV events on (``kv_events_endpoint: auto``): exact prefix routing;
* ``prefix_affinity`` with KV events off: today's approximate prefix index;
* ``round_robin``.

Prints per policy TTFT P50/P90/P99 (all requests, and the steady phase: requests sent
10 s or more after the last tenant's first request), E2E P99, throughput, errors,
requests per backend, "tenant moves" (requests sent to a backend that never served
their tenant before), the prefix hit rate from the twins' own counters
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` summed over
backends, deltas over the run) and its ratio to an oracle that knows every engine's
cache (each request after its tenant's first hits its tenant prefix in whole 16-token
blocks), the gateway's ``kv_events`` modes polled from ``/admin/config`` during the
run, then each target with met / NOT met: P90 TTFT of default <= 0.2x prefix_affinity
and <= 0.1x round robin; hit rate >= 0.95 x oracle. Reports (bench client format)
under ``--out``. ``--default-params JSON`` and ``--max-prefix-tokens N`` (a gateway
option) are for experiments; ``--workers`` sets the gateway's processes (default 1:
one process, as the docs' figures were measured; ``auto`` is the gateway's default).
Wall-clock numbers on a shared 2-core machine: compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import aiohttp  # noqa: E402

from kiloserve.bench.client import ClientOptions, run_bench  # noqa: E402
from kiloserve.catalog import get_gpu, get_model  # noqa: E402
from kiloserve.engine.timing import StepTimeModel  # noqa: E402
from kiloserve.launch.cluster import LocalCluster, describe_backend  # noqa: E402
from kiloserve.launch.config import ClusterConfig, parse_cluster_config  # noqa: E402
from kiloserve.results.metrics import summarize, tenant_moves  # noqa: E402
from kiloserve.results.records import RequestRecord  # noqa: E402
from kiloserve.results.report import write_report  # noqa: E402
from kiloserve.tokens import tokenize  # noqa: E402
from kiloserve.workload import OpenLoop, RequestSpec, Workload  # noqa: E402
from kiloserve.workload.arrivals import request_rate_arrivals  # noqa: E402
from kiloserve.workload.prompts import NS_GROUP, NS_UNIQUE, PromptBuilder, split_tokens  # noqa: E402

BLOCK = 16  # the twins' and the gateway's block size
RUNS = (("default", True), ("prefix_affinity", False), ("round_robin", False))
PREFIX_TOKENS = (4000, 6000)
USER_TOKENS = (32, 128)
OUTPUT_TOKENS = (16, 64)
METRIC = re.compile(r"^(vllm:prefix_cache_(?:queries|hits)_total)(?:\{[^}]*\})?\s+(\S+)$")


def cluster_config(args: argparse.Namespace, kv_events: bool) -> ClusterConfig:
    line: dict[str, Any] = {"name": "twin", "gpu": args.gpu, "model": args.model,
                            "count": args.num_backends}  # fmt: skip
    if kv_events:
        line |= {"kv_events_endpoint": "auto", "kv_events_replay_endpoint": "auto"}
    return parse_cluster_config({"name": "prefix-routing", "host": "127.0.0.1",
                                 "gateway": {"host": "127.0.0.1"}, "backends": [line]})  # fmt: skip


def tenant_prefixes(args: argparse.Namespace) -> list[int]:
    """Each tenant's system-prompt length in tokens."""
    rng = np.random.default_rng([args.seed, 7])
    return [int(n) for n in rng.integers(PREFIX_TOKENS[0], PREFIX_TOKENS[1] + 1, args.tenants)]


def tenant_of(spec: RequestSpec) -> int:
    return int((spec.prefix_group or "").removeprefix("tenant-"))


def tenant_workload(args: argparse.Namespace, rate: float) -> Workload:
    """Each request: its tenant's system prompt (4-6k tokens), a unique user turn."""
    prefix = tenant_prefixes(args)
    rng = np.random.default_rng([args.seed, 8])
    n = args.num_requests
    tenants = rng.integers(args.tenants, size=n).tolist()
    users = rng.integers(USER_TOKENS[0], USER_TOKENS[1] + 1, size=n).tolist()
    outs = rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1, size=n).tolist()

    def make() -> Iterator[RequestSpec]:
        builder = PromptBuilder()
        arrivals = request_rate_arrivals(rate, 1.0, seed=args.seed)
        for i, arrival_s in zip(range(n), arrivals, strict=False):
            t = tenants[i]
            segments = split_tokens((NS_GROUP, args.seed, t), prefix[t])
            segments += split_tokens((NS_UNIQUE, args.seed, i), users[i])
            yield RequestSpec(f"t{t:03d}-{i:05d}", arrival_s, prefix[t] + users[i], outs[i],
                              builder.render(segments), prefix_group=f"tenant-{t}")  # fmt: skip

    params = {"tenants": args.tenants, "prefix_tokens": PREFIX_TOKENS, "rate": rate}
    return Workload("tenants", args.seed, make, n, params)


def check_shared_heads(workload: Workload, prefix: list[int]) -> None:
    """Two requests of one tenant tokenise (the twin's tokenizer) to exactly
    ``input_tokens`` ids and share at least the tenant's whole prompt."""
    first: dict[int, RequestSpec] = {}
    for spec in workload:
        t = tenant_of(spec)
        other = first.setdefault(t, spec)
        if other is spec:
            continue
        a, b = tokenize(other.prompt), tokenize(spec.prompt)
        assert (len(a), len(b)) == (other.input_tokens, spec.input_tokens), "token counts"
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        assert same >= prefix[t], (same, prefix[t])
        print(f"check: two requests of tenant {t} share their first {same} token ids "
              f"(its prompt: {prefix[t]})")  # fmt: skip
        return
    raise AssertionError("no tenant with two requests")


def oracle(workload: Workload, prefix: list[int]) -> tuple[float, int]:
    """(hit rate, prompt tokens) of an oracle that knows every engine's cache (and has
    KV enough): each request after its tenant's first hits the tenant's prompt, in
    whole blocks."""
    seen: set[int] = set()
    hits = total = 0
    for spec in workload:
        t = tenant_of(spec)
        if t in seen:
            hits += prefix[t] // BLOCK * BLOCK
        seen.add(t)
        total += spec.input_tokens
    return hits / total, total


def cold_capacity(args: argparse.Namespace, mean_prompt: float) -> tuple[float, float]:
    """(requests/s of the cluster when every request prefills its whole prompt, s per
    prefill): chunked prefill of the mean prompt on one twin (the step-time model)."""
    gpu = get_gpu(args.gpu)
    model = StepTimeModel(gpu, get_model(args.model))
    chunk, done, prefill_s = gpu.max_num_batched_tokens, 0, 0.0
    while done < mean_prompt:
        n = int(min(chunk, mean_prompt - done))
        prefill_s += model.step_time_s([(n, done)], [])
        done += n
    return args.num_backends / prefill_s, prefill_s


async def scrape_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for url in urls:
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            values: dict[str, float] = {}
            for line in text.splitlines():
                m = METRIC.match(line)
                if m:
                    values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
            out[url] = values
    return out


async def poll_kv_events(gateway: str, stop: asyncio.Event, seen: list[dict[str, Any]]) -> None:
    """``/admin/config`` ``kv_events`` every 5 s (and once at the end) into ``seen``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while True:
            try:
                async with s.get(gateway + "/admin/config") as r:
                    seen.append((await r.json()).get("kv_events") or {})
            except (aiohttp.ClientError, TimeoutError) as exc:
                print(f"  /admin/config failed: {exc!r}", flush=True)
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 5.0)


async def wait_exact(gateway: str, num_backends: int, timeout_s: float = 3.0) -> str:
    """Until ``/admin/config`` shows every backend's KV events ``exact`` (or timeout)."""
    started = time.monotonic()
    modes: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while time.monotonic() - started < timeout_s:
            async with s.get(gateway + "/admin/config") as r:
                kv = (await r.json()).get("kv_events") or {}
            modes = [e["mode"] for e in kv.values()]
            if modes.count("exact") == num_backends:
                return f"all {num_backends} backends exact after {time.monotonic() - started:.1f} s"
            await asyncio.sleep(0.2)
    return f"NOT all exact after {timeout_s:.0f} s: {dict(Counter(modes))}"


async def one_run(
    cluster: LocalCluster, model: str, workload: Workload, kv_events: bool
) -> dict[str, Any]:
    gateway = cluster.gateway_url
    assert gateway is not None
    urls = [b.url for b in cluster.backends]
    if kv_events:
        print(f"  before the run: {await wait_exact(gateway, len(urls))}", flush=True)
    before = await scrape_counters(urls)
    stop, seen = asyncio.Event(), []
    poller = asyncio.create_task(poll_kv_events(gateway, stop, seen))
    started = time.monotonic()
    result = await run_bench(gateway, model, workload, OpenLoop(None),
                             options=ClientOptions(timeout_s=300))  # fmt: skip
    wall_s = time.monotonic() - started
    stop.set()
    await poller
    after = await scrape_counters(urls)
    q = sum(after[u].get("vllm:prefix_cache_queries_total", 0) - before[u].get(
        "vllm:prefix_cache_queries_total", 0) for u in urls)  # fmt: skip
    h = sum(after[u].get("vllm:prefix_cache_hits_total", 0) - before[u].get(
        "vllm:prefix_cache_hits_total", 0) for u in urls)  # fmt: skip
    return {"result": result, "queries": q, "hits": h, "kv_events": seen, "wall_s": wall_s}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def steady_start_s(workload: Workload) -> float:
    """Start of the steady phase: 10 s after the last tenant's first arrival (before it
    every policy pays the tenants' cold prefills, which dominate P90 TTFT)."""
    first: dict[str | None, float] = {}
    for spec in workload:
        first.setdefault(spec.prefix_group, spec.arrival_s or 0.0)
    return max(first.values()) + 10.0


def steady_ttfts_ms(records: list[RequestRecord], start_s: float) -> list[float]:
    return [r.ttft_s * 1000 for r in records
            if r.is_ok and r.ttft_s is not None and (r.scheduled_s or 0.0) >= start_s]  # fmt: skip


def kv_events_line(seen: list[dict[str, Any]]) -> str:
    if not seen or not any(seen):
        return "kv_events: none (no backend publishes)"
    modes = Counter(e["mode"] for poll in seen for e in poll.values())
    last = seen[-1]
    keys = ("events", "batches", "gaps", "resyncs", "restarts", "bad_messages")
    tot = {k: sum(int(e.get(k, 0)) for e in last.values()) for k in keys}
    blocks = [int(e.get("blocks", 0)) for e in last.values()]
    return (f"kv_events: {len(seen)} polls, backend-modes {dict(modes)}; at the end "
            f"{sum(e['mode'] == 'exact' for e in last.values())}/{len(last)} exact, "
            f"events {tot['events']}, batches {tot['batches']}, gaps {tot['gaps']}, resyncs "
            f"{tot['resyncs']}, restarts {tot['restarts']}, bad {tot['bad_messages']}, "
            f"blocks per backend {min(blocks)}-{max(blocks)}")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    items = cluster_config(args, True).expanded()
    info = describe_backend(items[0], "http://-")
    model = info.model
    need = args.tenants * sum(PREFIX_TOKENS) / 2
    print(f"cluster: {args.num_backends} x {info.gpu} twins, {model}; KV per backend "
          f"{info.kv_capacity_tokens:,} tokens = {info.kv_capacity_tokens / need:.0%} of the "
          f"tenants' prefixes ({args.tenants} x ~{sum(PREFIX_TOKENS) // 2:,} = {need:,.0f}); "
          f"cluster KV {args.num_backends * info.kv_capacity_tokens / need:.1f}x them")  # fmt: skip
    mean_prompt = sum(PREFIX_TOKENS) / 2 + sum(USER_TOKENS) / 2
    cap, prefill_s = cold_capacity(args, mean_prompt)
    rate = args.rate or args.load * cap
    print(f"capacity: a {mean_prompt:,.0f}-token prompt prefills in {prefill_s * 1000:.0f} ms "
          f"on one twin (chunks of {get_gpu(args.gpu).max_num_batched_tokens}), so the "
          f"cluster serves ~{cap:.1f} req/s when no request hits the cache (decode of 16-64 "
          f"tokens rides along in the same steps); rate {rate:.2f} req/s = "
          f"{rate / cap:.0%} of that (hits only lower the load)")  # fmt: skip
    workload, prefix = tenant_workload(args, rate), tenant_prefixes(args)
    check_shared_heads(workload, prefix)
    oracle_rate, total = oracle(workload, prefix)
    steady_s = steady_start_s(workload)
    num_steady = sum((spec.arrival_s or 0.0) >= steady_s for spec in workload)
    print(f"workload: {args.num_requests} requests over ~{args.num_requests / rate:.0f} s, "
          f"{args.tenants} tenants, {total:,} prompt tokens; oracle hit rate "
          f"{oracle_rate:.3f}; steady phase (10 s after the last tenant's first request) "
          f"from {steady_s:.0f} s: {num_steady} requests\n", flush=True)  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for policy, kv_events in RUNS:
        if args.policies and policy not in args.policies:
            continue
        label = f"{policy} (KV events {'on' if kv_events else 'off'})"
        print(f"== {label}: starting {args.num_backends} twins + gateway ...", flush=True)
        options: dict[str, Any] = {"seed": args.seed, "workers": args.workers}
        if args.max_prefix_tokens is not None:
            options["max_prefix_tokens"] = args.max_prefix_tokens
        params = json.loads(args.default_params) if policy == "default" else {}
        cluster = LocalCluster(
            cluster_config(args, kv_events), gateway=True, policy=policy, policy_params=params,
            gateway_port=0, run_dir=args.out / policy / "logs", gateway_options=options,
            start_timeout_s=120,
        )  # fmt: skip
        with cluster:
            out = asyncio.run(one_run(cluster, model, workload, kv_events))
        result = out["result"]
        summary = summarize(result, None)
        summary["policy"] = policy
        write_report(args.out / policy, result, summary, plot=False)
        hit = out["hits"] / out["queries"] if out["queries"] else math.nan
        steady = steady_ttfts_ms(list(result.records), steady_s)
        counts = sorted(int(v["count"]) for v in summary["per_backend"].values())
        moves = tenant_moves(list(result.records))
        rows[policy] = {
            "summary": summary, "hit": hit, "steady_p50": pct(steady, 50),
            "steady_p90": pct(steady, 90), "counts": counts, "moves": moves,
        }  # fmt: skip
        t, e = summary["ttft_ms"], summary["e2e_ms"]
        print(f"  TTFT ms p50 {t['p50']:.0f} p90 {t['p90']:.0f} p99 {t['p99']:.0f}; steady "
              f"p50 {pct(steady, 50):.0f} p90 {pct(steady, 90):.0f}; E2E p99 {e['p99']:.0f}; "
              f"{summary['request_throughput']:.2f} req/s; failed {summary['requests_failed']}; "
              f"per backend {counts}; tenant moves {moves}")  # fmt: skip
        print(f"  hit rate {hit:.3f} (twins: {out['hits']:,.0f} / {out['queries']:,.0f} tokens) "
              f"= {hit / oracle_rate:.3f} of the oracle; wall {out['wall_s']:.0f} s; client "
              f"lag p99 {summary['client_lag_ms']['p99']:.0f} ms")  # fmt: skip
        print(f"  {kv_events_line(out['kv_events'])}", flush=True)
    report(rows, oracle_rate)
    return 0


def report(rows: dict[str, dict[str, Any]], oracle_rate: float) -> None:
    print("\n| policy | TTFT P50 | P90 | P99 | steady P50 | steady P90 | E2E P99 | req/s | failed "
          "| hit rate | hit / oracle | requests per backend | tenant moves |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for policy, r in rows.items():
        s = r["summary"]
        t, e = s["ttft_ms"], s["e2e_ms"]
        print(f"| {policy} | {t['p50']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | "
              f"{r['steady_p50']:.0f} | {r['steady_p90']:.0f} | {e['p99']:.0f} | "
              f"{s['request_throughput']:.2f} | "
              f"{s['requests_failed']} | {r['hit']:.3f} | {r['hit'] / oracle_rate:.3f} | "
              f"{r['counts'][0]}-{r['counts'][-1]} | {r['moves']} |")  # fmt: skip
    if "default" not in rows:
        return
    d = rows["default"]
    print("\n## Targets (whole run; the steady phase alone for information)")
    for base, target in (("prefix_affinity", 0.2), ("round_robin", 0.1)):
        if base not in rows:
            continue
        b = rows[base]
        ratio = float(d["summary"]["ttft_ms"]["p90"]) / float(b["summary"]["ttft_ms"]["p90"])
        steady = d["steady_p90"] / b["steady_p90"]
        print(f"P90 TTFT default / {base:<15} = {ratio:.3f}  (target <= {target}: "
              f"{_verdict(ratio <= target)}); steady phase {steady:.3f} "
              f"({_verdict(steady <= target)})")  # fmt: skip
    ratio = d["hit"] / oracle_rate
    print(
        f"hit rate default / oracle          = {ratio:.3f}  (target >= 0.95: "
        f"{_verdict(ratio >= 0.95)})"
    )


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="48 tenants, 500 requests (~4 min)")
    p.add_argument("--tenants", type=int, help="default 100 (quick: 48)")
    p.add_argument("--num-requests", type=int, help="default 1500 (quick: 500)")
    p.add_argument("--load", type=float, default=0.75, help="share of the cold capacity")
    p.add_argument("--rate", type=float, help="requests/s (overrides --load)")
    p.add_argument("--gpu", default="L40S")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--num-backends", type=int, default=8)
    p.add_argument("--policies", type=lambda s: s.split(","), help="subset of the three runs")
    p.add_argument("--default-params", default="{}", help="JSON params of the default run")
    p.add_argument("--max-prefix-tokens", type=int, help="gateway option (default 2048)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument(
        "--workers", default="1",
        help="gateway worker processes (default 1, as the figures in docs/policies.md were "
        "measured; 'auto' is the gateway's own default: one per usable CPU)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "runs" / "prefix-routing")
    args = p.parse_args()
    args.tenants = args.tenants or (48 if args.quick else 100)
    args.num_requests = args.num_requests or (500 if args.quick else 1500)
    # SIGTERM as Ctrl-C: the clusters' context managers stop every child on the way out.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
