"""The default policy, never beaten: every shipped policy x workload family x load, 1,024 GPUs.

    .venv/bin/python benchmarks/default_matrix.py --quick        # 70% load, 7 policies
    .venv/bin/python benchmarks/default_matrix.py                # 50/70/90%, all policies
    .venv/bin/python benchmarks/default_matrix.py --workloads unique,mix \\
        --policies least_request,default --loads 0.9 --json /tmp/matrix.json
    .venv/bin/python benchmarks/default_matrix.py --live --capacities /tmp/caps.json \\
        --json /tmp/matrix-live.json                             # live: twins + gateway
    .venv/bin/python benchmarks/default_matrix.py --policies default \\
        --default-params '{"sticky_abs_load": 4}'               # the default, other params

The contract (issue): on every workload family, at 50-90% load in the simulator at 1,024
GPUs (``examples/cluster-1024.yaml``), no shipped policy beats ``default`` by more than
10% on TTFT P99, E2E P99 or goodput; below saturation no GPU type sits idle while
another queues; every report gives the prefix-cache hit rate. The same contract holds
live on the example cluster (``--live``, below).

Setup:

* Cluster ``examples/cluster-1024.yaml`` (368 backends, 1,024 GPUs, KV events on), every
  request sent to ``--model`` (default ``Llama-3.1-70B``: 160 x TP4 H100 + 48 x TP4 A100
  = 832 GPUs, the pool with two GPU types; the other pools sit idle and are left out of
  the busy fractions). ``--model all`` spreads requests over the three model pools by
  GPUs (loads are then fractions of the bottleneck pool's capacity).
* Workload families (``FAMILIES``): unique prompts (Azure conversation trace), multi-turn
  sessions, the Mooncake conversation trace (real shared prefixes), shared system
  prompts (100 groups x 5,000 tokens, short unique tails), long documents, a mix.
* Loads 50/70/90% of the family's capacity. Capacity (printed, with the method): the
  rate where throughput stops following the offered rate, per backend line (GPU x TP x
  model) on ONE replica of that line: double / halve, then bisect to 5%, the highest
  rate at which the requests finishing in the last two thirds of >= 240 s of arrivals
  are >= 90% of those arriving then (``keeps_up``); the cluster's capacity is the sum
  over replicas (the ideal, perfectly balanced cluster; a router that overloads the
  slower A100s saturates earlier). A probe sees its replica's share of the traffic as
  under least-request routing: for sessions it runs every user's six turns (12,000
  requests), a user's turns so far apart that none hits the cache (the capacity
  without session affinity: every policy can carry 90% of it). ``--capacities PATH``
  caches the searches in a JSON file (read when present).
* Every policy of ``available_policies()`` except ``canary`` (needs version splits) and
  ``scored`` (``default`` unless configured); the same request sequence for each.
* Each run: ``--span`` seconds of arrivals at ``load x capacity`` (longer where that is
  under ``--min-requests``, e.g. Mooncake's ~50 req/s, the warmup scaled alike);
  latencies and goodput are measured on the requests arriving after ``--warmup`` (the
  cluster fills up first), busy fractions over the same window (from the per-backend
  utilisation series), the prefix-cache hit rate over the whole run (the engines'
  counters). Runs start from cold caches: with 100 prefix groups a replica sees each
  group only a few times in a run, so prefix-blind policies miss far more than they
  would in a long steady state (the one-replica probe, 240 s, is warm).
* Metrics: TTFT P99, E2E P99, goodput = requests/s (of the measured window's arrivals)
  meeting the SLO ``ttft <= 2 s, tpot <= 100 ms`` (``kiloserve.results.metrics.is_good``).

Prints one block per (workload, load) with every policy's numbers, then the matrix: per
row the default's numbers, the worst ratio of any other policy for each metric (latency:
min over others of other / default; goodput: min of default / other; below 1 means some
policy does better, and which one), the verdict ("default never beaten" unless some
policy is better by more than 10%: latency < 0.9 x default, goodput > 1.1 x default) and
the default's per-GPU-type busy fractions with an idle-pool check (one type < 0.2 busy
while another queues: the P90 engine queue time of the requests it served, vLLM's
``request_queue_time_seconds``, over 500 ms; not a long TTFT, which long prompts have on
an idle engine, nor a busy engine, which runs a batch without anyone waiting; every
run's check is in the JSON).

Runtime on a shared 2-core machine: ``--quick`` about 25 minutes (capacity searches
cached with ``--capacities``; 10-15 more the first time), the full matrix (198
simulations, up to 43,000 requests each) a few hours; ``default`` is the slowest policy
to simulate (KV events, scoring).

Live (``--live``): the same contract on real processes.

* Cluster: the Llama-3.1-8B pool of ``examples/cluster.yaml`` (``llama_only`` of
  ``routing_quality.py``: 2 x H100, 2 x A100, 1 x L40S engine twins, KV events on as
  the example enables them) behind the real gateway on 127.0.0.1. As
  ``kiloserve.bench.compare.compare_policies`` does, every policy gets a freshly
  started cluster (no warm caches from the policy before) and the identical request
  sequence (``--live-requests``, default 300, open loop; prompts included), streamed
  through the gateway; per-run reports and twin logs under ``--live-out``, one
  ``comparison.md`` per row.
* Capacity: the same per-replica search as above, on the example's three Llama lines
  (GPU x TP x model), summed over the 5 replicas; simulated, which applies because the
  twins run the simulator's engine model (one simulated replica's capacity is a twin's).
  ``--capacities`` caches it as above (the first time: a few minutes per family, the
  multi-turn family's 12,000-request probes the longest).
* Defaults: load 70% only, the 7 ``--quick`` policies, every family (``--loads``,
  ``--policies``, ``--workloads`` change them); measured after the same share of each
  run's arrivals as the simulator's ``--warmup / --span`` (a third). Multi-turn runs
  with ``--live-requests / 6`` users (49: coprime with the 5 backends, see
  ``live_spec``), so every user sends all six turns; the capacity is still the 2,000-user probe's.
* Same metrics, SLO, verdicts and matrix. Live there are no busy fractions or engine
  queue times: the tables show, per GPU type, its share of the measured requests and
  their TTFT P99 instead, and the idle check says "n/a live". The hit rate is the
  bench's (``prefix_cache.hit_rate``: the engines' own counters through the gateway).
* Wall-clock numbers: on a CPU-starved box (the shared 2-core machine: five twins, the
  gateway and the client on two cores) the twins' loops fall behind the modelled step
  times and every live latency inflates. A twin logs that as a WARNING (its
  ``kiloserve_twin_loop_lag_seconds`` gauge); each run prints the worst lag logged per
  twin, and the client's own lag / late-dispatch warnings, under its line, and the
  matrix counts the runs that lagged. Compare ratios, and rerun lagged rows on a
  quieter machine before calling a verdict.
* Runtime (shared 2-core box): a run is ~10 s of cluster start-up and report, its
  arrivals and the drain. At 70% of capacity 300 requests arrive in ~11-15 s for
  unique, multi-turn, system-prompt and mix (20-35 req/s; ~30-45 s a run), ~80 s for
  long documents (4 req/s; ~2 min a run) and ~300 s for Mooncake (1.15 req/s, 14k-token
  prompts; ~6 min a run). The default ``--live`` (6 families x 7 policies = 42 runs)
  takes about 75 minutes, 40 of them Mooncake (``--workloads`` without it: ~35); the
  first capacity searches of the example's lines add ~10-20 minutes (cache them with
  ``--capacities``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from routing_quality import llama_only  # noqa: E402

from kiloserve.bench.client import ClientOptions, run_bench  # noqa: E402
from kiloserve.launch.cluster import BackendInfo, LocalCluster  # noqa: E402
from kiloserve.launch.config import ClusterConfig, load_cluster_config  # noqa: E402
from kiloserve.policies import available_policies  # noqa: E402
from kiloserve.results.metrics import Slo, is_good, summarize  # noqa: E402
from kiloserve.results.records import RequestRecord  # noqa: E402
from kiloserve.results.report import write_comparison, write_report  # noqa: E402
from kiloserve.sim import simulate  # noqa: E402
from kiloserve.sim.cluster import describe_backends  # noqa: E402
from kiloserve.workload import OpenLoop, Workload, load_workload  # noqa: E402

CLUSTER = REPO / "examples" / "cluster-1024.yaml"
MODEL = "Llama-3.1-70B"
LOADS = (0.5, 0.7, 0.9)
QUICK_LOADS = (0.7,)
QUICK_POLICIES = (
    "round_robin", "least_request", "least_tokens", "power_of_two", "prefix_affinity",
    "session_affinity", "default",
)  # fmt: skip
SKIPPED = {"canary": "needs version splits", "scored": "same as default unless configured"}
SLO = Slo(ttft_ms=2000.0, tpot_ms=100.0)
MARGIN = 0.10  # "better by more than 10%"
IDLE_BUSY = 0.2  # idle: busy under 0.2 of the measured window
QUEUE_P90_MS = 500.0  # queueing: P90 engine queue time over a quarter of the TTFT SLO
KEEP_UP = 0.9  # finished / arrived over the probe's window: the replica keeps up
PROBE_SPAN_S = 240.0
PROBE_MAX_REQUESTS = 20_000
MAX_PROBES = 10
CAPACITY_TOLERANCE = 0.05
METRICS = ("ttft_p99_ms", "e2e_p99_ms", "goodput_rps")
# --live: the Llama pool of the example cluster (engine twins + the real gateway)
LIVE_CLUSTER = REPO / "examples" / "cluster.yaml"
LIVE_MODEL = "Llama-3.1-8B"
LIVE_REQUESTS = 300
LIVE_OUT = REPO / "runs" / "default-matrix-live"
LIVE_TIMEOUT_S = 300.0  # per request
LIVE_START_TIMEOUT_S = 120.0  # five twins and a gateway on a busy 2-core box
TWIN_LAG = re.compile(r"loop lags (\d+) ms")  # the twins' sustained-lag WARNING (LagTracker)


@dataclass(frozen=True, slots=True)
class Family:
    """A workload family: its spec and what its one-replica capacity probe needs."""

    spec: str
    what: str = ""
    probe_requests: int = 0  # at least this many requests per probe (0: PROBE_SPAN_S)


FAMILIES: dict[str, Family] = {
    "unique": Family("azure-conv:repeat=inf", what="unique prompts (Azure conversation trace)"),
    "multi-turn": Family(
        "sessions:users=2000,turns=6,input=lognormal(400,0.8),output=lognormal(200,0.5)",
        "multi-turn chats: 2,000 users x 6 turns, each turn extends the last prompt",
        probe_requests=12_000,  # every user's 6 turns: the late turns' long prompts count
    ),
    "mooncake": Family("mooncake:repeat=inf", what="Mooncake conversation trace (shared prefixes)"),
    "system-prompt": Family(
        "synthetic:input=lognormal(200,0.5),output=lognormal(200,0.5),"
        "prefix_groups=100,prefix_tokens=5000",
        what="shared system prompts: 100 groups x 5,000 tokens + ~200 unique tokens",
    ),
    "longdoc": Family("mix:longdoc=1", what="long documents: lognormal(8000) in, (300) out"),
    "mix": Family("mix:chat=0.6,longdoc=0.1,short=0.3", what="chat + long documents + short"),
}  # fmt: skip


# -- cluster and capacity ------------------------------------------------------------------
def served_infos(infos: Sequence[BackendInfo], model: str | None) -> list[BackendInfo]:
    return [i for i in infos if model is None or i.model == model]


def one_replica(cluster: ClusterConfig, line: str) -> ClusterConfig:
    """The backend line ``line`` of ``cluster`` with a single replica (its YAML settings)."""
    data: dict[str, Any] = cluster.model_dump(mode="json", exclude_none=True)
    data["backends"] = [{**b, "count": 1} for b in data["backends"] if b["name"] == line]
    return ClusterConfig.model_validate(data)


def line_of(backend_name: str, lines: Iterable[str]) -> str:
    """The YAML line an expanded backend (``h100-70b-17``) comes from."""
    return max((n for n in lines if backend_name == n or backend_name.startswith(f"{n}-")),
               key=len)  # fmt: skip


def keeps_up(
    single: ClusterConfig, family: Family, rate_rps: float, args: argparse.Namespace
) -> dict[str, Any]:
    """One probe: ``spec`` at ``rate_rps`` on one replica for ``PROBE_SPAN_S`` of arrivals;
    it keeps up when the requests finishing in the last two thirds of the arrival span
    are at least ``KEEP_UP`` of those arriving then (throughput follows the offered rate)."""
    count = max(200, family.probe_requests,
                min(PROBE_MAX_REQUESTS, math.ceil(rate_rps * PROBE_SPAN_S)))  # fmt: skip
    workload = load_workload(family.spec, seed=args.seed, num_requests=count, rate=rate_rps,
                             with_prompts=False, traces_dir=args.traces_dir)  # fmt: skip
    result = simulate(single, workload, "least_request", seed=args.seed,
                      traces_dir=args.traces_dir, keep_records=True)  # fmt: skip
    span_s = float(result.summary["arrival_span_s"])
    start_s = span_s / 3.0
    arrived = sum(1 for r in result.records if start_s <= r.start_s <= span_s)
    done = sum(1 for r in result.records
               if start_s <= r.start_s + (r.e2e_s or 0.0) <= span_s)  # fmt: skip
    ratio = done / arrived if arrived else 0.0
    failed = result.summary["requests_failed"]
    del result
    gc.collect()  # a simulation leaves reference cycles holding its big buffers
    return {"rate_rps": rate_rps, "done_per_arrived": round(ratio, 3),
            "keeps_up": ratio >= KEEP_UP, "failed": failed}  # fmt: skip


def replica_capacity(
    cluster: ClusterConfig, line: str, family: Family, first_rps: float,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """The highest rate one replica of backend line ``line`` keeps up with: double (or
    halve) from ``first_rps`` until a kept-up and a lost rate bracket it, then bisect
    geometrically to ``CAPACITY_TOLERANCE`` (at most ``MAX_PROBES`` probes)."""
    single = one_replica(cluster, line)
    probes: list[dict[str, Any]] = []
    low = high = None
    rate = first_rps
    while len(probes) < MAX_PROBES:
        probes.append(keeps_up(single, family, rate, args))
        if probes[-1]["keeps_up"]:
            low = rate
        else:
            high = rate
        if low is not None and high is not None:
            if high / low <= 1.0 + CAPACITY_TOLERANCE:
                break
            rate = math.sqrt(low * high)
        else:
            rate = rate * 2.0 if high is None else rate / 2.0
    return {"rps": low or 0.0, "is_bracketed": low is not None and high is not None,
            "probes": probes}  # fmt: skip


def family_capacity(
    cluster: ClusterConfig, infos: Sequence[BackendInfo], family: Family,
    args: argparse.Namespace, cache: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Requests/s the served pool(s) sustain: per-line replica capacity x replicas."""
    lines = [b.name for b in cluster.backends]
    counts: dict[str, int] = {}
    models: dict[str, str] = {}
    for info in served_infos(infos, args.model):
        line = line_of(info.name, lines)
        counts[line] = counts.get(line, 0) + 1
        models[line] = info.model
    per_line: dict[str, Any] = {}
    first = 2.0
    for line in counts:
        key = f"{cluster.name}|{line}|{family.spec}|n>={family.probe_requests}|seed={args.seed}"
        if key not in cache:
            t0 = time.perf_counter()
            cache[key] = replica_capacity(cluster, line, family, first, args)
            cache[key]["wall_s"] = round(time.perf_counter() - t0, 1)
        per_line[line] = {**cache[key], "replicas": counts[line], "model": models[line]}
        first = max(0.05, cache[key]["rps"]) or first
    by_model: dict[str, float] = {}
    for block in per_line.values():
        by_model[block["model"]] = (
            by_model.get(block["model"], 0.0) + block["rps"] * block["replicas"]
        )
    if args.model is not None:
        total = by_model[args.model]
    else:  # requests split by GPUs: the pool that saturates first bounds the cluster
        gpus: dict[str, float] = {}
        for info in infos:
            gpus[info.model] = gpus.get(info.model, 0.0) + info.tp
        share = {m: g / sum(gpus.values()) for m, g in gpus.items()}
        total = min(c / share[m] for m, c in by_model.items())
    return {"rps": total, "per_line": per_line}


def live_spec(spec: str, num_requests: int, num_backends: int) -> str:
    """``--live``: a sessions spec with only as many users as ``num_requests`` holds whole
    sessions (300 requests: 49 users x 6 turns here). Requests are dealt to users round
    robin, so 300 requests over 2,000 users would all be first turns; the simulator's
    runs (thousands of requests) reach the later turns. The user count is made coprime
    with ``num_backends``: with 50 users on 5 backends, round robin sent every turn of a
    user to the same backend (request i and i + 50 alike), perfect session affinity by
    accident (measured: hit rate 0.70 against 0.31 for least request). Other specs are
    unchanged."""
    turns = re.search(r"turns=(\d+)", spec)
    if not spec.startswith("sessions:") or turns is None:
        return spec
    users = max(1, num_requests // int(turns.group(1)))
    while users > 1 and math.gcd(users, num_backends) != 1:
        users -= 1
    return re.sub(r"users=\d+", f"users={users}", spec)


# -- one run ---------------------------------------------------------------------------------
def p99(values: Sequence[float]) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), 99)) if values else math.nan


def window_busy(
    series: Mapping[str, Any], gpu_of: Mapping[str, str], start_s: float, end_s: float
) -> dict[str, float]:
    """Mean busy fraction per GPU type over samples taken in ``(start_s, end_s]``."""
    times = series.get("t_s", [])
    keep = [i for i, t in enumerate(times) if start_s < t <= end_s]
    sums: dict[str, list[float]] = {}
    for backend, gpu in gpu_of.items():
        column = series["utilisation"].get(backend) or []
        values = [column[i] for i in keep if i < len(column)]
        if values:
            acc = sums.setdefault(gpu, [0.0, 0.0])
            acc[0] += sum(values)
            acc[1] += len(values)
    return {gpu: s / n for gpu, (s, n) in sums.items() if n}


def measured(
    records: Sequence[Any], span_s: float, warmup_s: float
) -> tuple[dict[str, Any], list[Any]]:
    """The row metrics over the requests arriving after ``warmup_s`` (sim and live alike),
    and those of them that succeeded."""
    window = [r for r in records if (r.scheduled_s or 0.0) >= warmup_s]
    ok = [r for r in window if r.is_ok and r.ttft_s is not None and r.e2e_s is not None]
    measured_s = max(1e-9, span_s - warmup_s)
    num_good = sum(1 for r in window if is_good(r, SLO))
    return {
        "ttft_p99_ms": p99([r.ttft_s * 1000.0 for r in ok]),
        "e2e_p99_ms": p99([r.e2e_s * 1000.0 for r in ok]),
        "goodput_rps": num_good / measured_s,
        "slo_attainment": num_good / len(window) if window else math.nan,
        "measured_requests": len(window),
        "failed": len(window) - len(ok),
    }, ok  # fmt: skip


def run_one(
    cluster: ClusterConfig, workload: Any, policy: str, gpu_of: Mapping[str, str],
    span_s: float, warmup_s: float, args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    params = args.default_params if policy == "default" else None
    result = simulate(cluster, workload, policy, policy_params=params, seed=args.seed,
                      model=args.model, traces_dir=args.traces_dir, keep_records=True,
                      slo=SLO)  # fmt: skip
    wall_s = time.perf_counter() - t0
    s = result.summary
    metrics, ok = measured(result.records, span_s, warmup_s)
    whole_run = {}
    for gpu, pool in s.get("pools", {}).items():
        n = sum(1 for g in gpu_of.values() if g == gpu)
        if n:  # busy_s over the served backends only (the others are idle by design)
            whole_run[gpu] = pool["busy_s"] / (n * s["simulated_duration_s"])
    out = {
        "policy": policy,
        **metrics,
        "prefix_hit_rate": s["prefix_cache"]["hit_rate"],
        "busy_window": window_busy(result.timeseries, gpu_of, warmup_s, span_s),
        "pool_ttft_p99_ms": pool_ttft_p99(ok, gpu_of),
        "pool_queue_p90_ms": pool_queue_p90(ok, gpu_of),
        "busy_whole_run": whole_run,
        "kv_events_publishers": s["kv_events"]["publishers"],
        "summary": {
            "ttft_p99_ms": s["ttft_ms"]["p99"], "e2e_p99_ms": s["e2e_ms"]["p99"],
            "goodput": s.get("goodput"), "slo_attainment": s.get("slo_attainment"),
            "requests_ok": s["requests_ok"], "requests_failed": s["requests_failed"],
            "simulated_duration_s": s["simulated_duration_s"],
            "arrival_span_s": s["arrival_span_s"],
        },
        "sim_wall_s": round(wall_s, 1),
    }  # fmt: skip
    del result, ok, s
    gc.collect()  # a simulation leaves reference cycles holding its big buffers
    return out


def run_live(
    cfg: ClusterConfig, make_workload: Callable[[], Workload], policy: str,
    gpu_of: Mapping[str, str], span_s: float, warmup_s: float, out_dir: Path,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, Any], list[RequestRecord]]:  # fmt: skip
    """One policy live, as ``kiloserve.bench.compare.compare_policies`` runs it: a fresh
    twin cluster and gateway (no warm caches from the policy before), the identical
    request sequence through the real gateway, open loop; the report in ``out_dir/policy``.
    Returns the row's numbers, the bench summary and the records."""
    t0 = time.perf_counter()
    cluster = LocalCluster(cfg, gateway=True, policy=policy, gateway_port=0,
                           run_dir=out_dir / policy / "logs",
                           gateway_options={"seed": args.seed, "workers": 1},  # one process
                           start_timeout_s=LIVE_START_TIMEOUT_S)  # fmt: skip
    with cluster:
        assert cluster.gateway_url is not None
        options = ClientOptions(timeout_s=LIVE_TIMEOUT_S)
        result = asyncio.run(run_bench(cluster.gateway_url, LIVE_MODEL, make_workload(),
                                       OpenLoop(None), options=options))  # fmt: skip
    s: dict[str, Any] = summarize(result, SLO)
    s["policy"] = policy
    write_report(out_dir / policy, result, s, plot=False)
    metrics, ok = measured(result.records, span_s, warmup_s)
    served: dict[str, int] = {}
    for r in result.records:
        gpu = gpu_of.get(r.backend or "")
        if (r.scheduled_s or 0.0) >= warmup_s and gpu is not None:
            served[gpu] = served.get(gpu, 0) + 1
    cache = s.get("prefix_cache") or {}
    warnings = [str(s[k]) for k in ("client_warning", "dispatch_warning") if s.get(k)]
    out = {
        "policy": policy,
        **metrics,
        "prefix_hit_rate": cache.get("hit_rate"),
        "request_share": {g: n / sum(served.values()) for g, n in served.items()},
        "pool_ttft_p99_ms": pool_ttft_p99(ok, gpu_of),
        "twin_lag_ms": twin_lag(out_dir / policy / "logs", gpu_of),
        "warnings": warnings,
        "summary": {
            "ttft_p99_ms": s["ttft_ms"]["p99"], "e2e_p99_ms": s["e2e_ms"]["p99"],
            "goodput": s.get("goodput"), "slo_attainment": s.get("slo_attainment"),
            "requests_ok": s["requests_ok"], "requests_failed": s["requests_failed"],
            "duration_s": s["duration_s"], "prefix_cache": cache,
        },
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    return out, s, list(result.records)


def twin_lag(log_dir: Path, twins: Iterable[str]) -> dict[str, int]:
    """Per twin, the worst loop lag (ms) its log warned about: a twin logs a WARNING when
    its loop stays behind the modelled step times (``LagTracker``: over 50 ms for 2 s;
    the value is also exported as ``kiloserve_twin_loop_lag_seconds``, a gauge that
    reads ~0 once the run has drained, hence the logs). Empty: no twin lagged."""
    worst_ms: dict[str, int] = {}
    for name in twins:
        path = log_dir / f"{name}.log"
        lags = [int(m) for m in TWIN_LAG.findall(path.read_text(errors="replace"))] if (
            path.exists()) else []  # fmt: skip
        if lags:
            worst_ms[name] = max(lags)
    return worst_ms


# -- verdicts --------------------------------------------------------------------------------
def worst(runs: Mapping[str, Mapping[str, Any]], metric: str) -> tuple[float, str]:
    """(worst ratio, policy): latency other / default, goodput default / other (min)."""
    d = float(runs["default"][metric])
    best = (math.inf, "-")
    for policy, run in runs.items():
        if policy == "default":
            continue
        o = float(run[metric])
        if metric == "goodput_rps":
            ratio = 1.0 if o == d else (d / o if o > 0 else math.inf)
        else:
            ratio = o / d if d > 0 else (1.0 if o == d else math.inf)
        if math.isnan(ratio):
            continue
        if ratio < best[0]:
            best = (ratio, policy)
    return best if best[1] != "-" else (math.nan, "-")


def verdict(ratios: Mapping[str, tuple[float, str]]) -> str:
    beaten = []
    for metric, (ratio, policy) in ratios.items():
        name = {"ttft_p99_ms": "TTFT P99", "e2e_p99_ms": "E2E P99", "goodput_rps": "goodput"}[
            metric
        ]
        if metric == "goodput_rps" and ratio < 1.0 / (1.0 + MARGIN):
            beaten.append(f"{policy} on {name} (+{(1.0 / ratio - 1.0) * 100:.0f}%)")
        elif metric != "goodput_rps" and ratio < 1.0 - MARGIN:
            beaten.append(f"{policy} on {name} (-{(1.0 - ratio) * 100:.0f}%)")
    return "default never beaten" if not beaten else "BEATEN by " + "; ".join(beaten)


def idle_check(run: Mapping[str, Any]) -> str:
    """ "IDLE ..." when a GPU type is under ``IDLE_BUSY`` busy while another queues (the
    P90 engine queue time of its requests over ``QUEUE_P90_MS``), else "ok".

    Queueing is the time a request waits in its engine's queue before it is first
    scheduled (vLLM's ``request_queue_time_seconds``), not a long TTFT or a busy engine:
    a 15k-token prompt takes seconds to prefill on an idle H100, and an engine running a
    batch is busy without anyone waiting. A slower GPU type left idle while the faster
    one keeps every request moving is the right call (it would only lengthen TTFTs)."""
    busy, queue = run["busy_window"], run.get("pool_queue_p90_ms", {})
    if len(busy) < 2:
        return "n/a (one GPU type)"
    for idle in sorted(busy, key=busy.__getitem__):
        if busy[idle] >= IDLE_BUSY:
            break
        for other in busy:
            q = queue.get(other, math.nan)
            if other != idle and q > QUEUE_P90_MS:
                return (f"IDLE {short(idle)} (busy {busy[idle]:.2f}) while {short(other)} "
                        f"queues (queue P90 {fmt_ms(q)} ms, busy {busy[other]:.2f})")  # fmt: skip
    return "ok"


def pool_queue_p90(records: Sequence[Any], gpu_of: Mapping[str, str]) -> dict[str, float]:
    """P90 engine queue time (ms) of the requests each GPU type served."""
    by_gpu: dict[str, list[float]] = {}
    for r in records:
        gpu = gpu_of.get(r.backend or "")
        if gpu is not None and r.queue_s is not None:
            by_gpu.setdefault(gpu, []).append(r.queue_s * 1000.0)
    return {gpu: float(np.percentile(v, 90)) for gpu, v in by_gpu.items()}


def pool_ttft_p99(records: Sequence[Any], gpu_of: Mapping[str, str]) -> dict[str, float]:
    """TTFT P99 (ms) of the requests each GPU type served."""
    by_gpu: dict[str, list[float]] = {}
    for r in records:
        gpu = gpu_of.get(r.backend or "")
        if gpu is not None:
            by_gpu.setdefault(gpu, []).append(r.ttft_s * 1000.0)
    return {gpu: p99(values) for gpu, values in by_gpu.items()}


def short(gpu: str) -> str:
    return gpu.split("-")[0]


def fmt_ms(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.0f}"


def fmt_busy(busy: Mapping[str, float]) -> str:
    return " ".join(f"{short(g)}={v:.2f}" for g, v in sorted(busy.items()))


def fmt_live_pools(share: Mapping[str, float], ttft_p99_ms: Mapping[str, float]) -> str:
    """Live: per GPU type, its share of the measured requests / their TTFT P99 (ms)."""
    return " ".join(f"{short(g)}={v:.2f}/{fmt_ms(ttft_p99_ms.get(g, math.nan))}"
                    for g, v in sorted(share.items()))  # fmt: skip


def pools_cell(run: Mapping[str, Any]) -> str:
    """Sim: busy fraction per GPU type; live (no busy fractions): request share / TTFT P99."""
    if "busy_window" in run:
        return fmt_busy(run["busy_window"])
    return fmt_live_pools(run["request_share"], run["pool_ttft_p99_ms"])


def block_header(live: bool) -> str:
    pools = "request share/TTFT p99 per GPU" if live else "busy (measured window)"
    return (f"  {'policy':>16} {'TTFT p99':>9} {'E2E p99':>9} {'goodput':>9} "
            f"{'SLO ok':>6} {'hit':>6}  {pools:<{38 if live else 22}} {'wall s':>6}")  # fmt: skip


def policy_line(run: Mapping[str, Any]) -> str:
    hit = run["prefix_hit_rate"]
    live = "busy_window" not in run
    return (f"  {run['policy']:>16} {fmt_ms(run['ttft_p99_ms']):>9} {fmt_ms(run['e2e_p99_ms']):>9} "
            f"{run['goodput_rps']:9.1f} {run['slo_attainment']:6.3f} "
            f"{'-' if hit is None else f'{hit:.3f}':>6}  {pools_cell(run):<{38 if live else 22}}"
            f" {run['wall_s' if live else 'sim_wall_s']:6.1f}")  # fmt: skip


def lag_line(run: Mapping[str, Any]) -> str | None:
    """Live: the twins' loop-lag warnings and the client's own, if any."""
    notes = list(run.get("warnings", []))
    if run.get("twin_lag_ms"):
        lags = ", ".join(f"{n} {ms} ms" for n, ms in run["twin_lag_ms"].items())
        notes.insert(0, f"twin loop lag (worst logged: {lags}): the host CPU is the "
                        "bottleneck, latencies are inflated")  # fmt: skip
    return "\n".join(f"    ! {n}" for n in notes) if notes else None


def print_matrix(rows: Sequence[Mapping[str, Any]], live: bool = False) -> None:
    pools = "request share/TTFT p99 (default)" if live else "busy (default)"
    print("\n## Matrix: default vs the best other policy per metric "
          "(ratio < 1: someone beats the default; beaten = better by > 10%)")  # fmt: skip
    print(f"{'workload':>13} {'load':>4} | {'def TTFT99':>10} {'def E2E99':>9} {'def good':>8} "
          f"{'hit':>5} | {'TTFT ratio (policy)':>28} {'E2E ratio (policy)':>28} "
          f"{'goodput ratio (policy)':>28} | {pools} idle-check | verdict")  # fmt: skip
    for row in rows:
        d = row["runs"]["default"]
        r = row["worst"]
        hit = d["prefix_hit_rate"]
        cells = [f"{r[m][0]:5.2f} ({r[m][1]})" for m in METRICS]
        print(f"{row['workload']:>13} {row['load']:4.0%} | {fmt_ms(d['ttft_p99_ms']):>10} "
              f"{fmt_ms(d['e2e_p99_ms']):>9} {d['goodput_rps']:8.1f} "
              f"{'-' if hit is None else f'{hit:.2f}':>5} | {cells[0]:>28} {cells[1]:>28} "
              f"{cells[2]:>28} | {pools_cell(d)} {row['idle_check'].split(' (')[0]} | "
              f"{row['verdict']}")  # fmt: skip
    beaten = [r for r in rows if r["verdict"] != "default never beaten"]
    print(f"\n{len(rows) - len(beaten)}/{len(rows)} rows: default never beaten.")
    for r in beaten:
        print(f"  {r['workload']} @ {r['load']:.0%}: {r['verdict']}")
    if live:
        print("idle pool while another queues: n/a live (the twins give no busy fractions or "
              "engine queue times; see the request shares)")  # fmt: skip
        lagged: dict[str, list[str]] = {}
        for r in rows:
            if laggy := [p for p, run in r["runs"].items() if run["twin_lag_ms"]]:
                lagged[f"{r['workload']} @ {r['load']:.0%}"] = laggy
        print(f"twin loop lag warnings: {sum(map(len, lagged.values()))} of "
              f"{sum(len(r['runs']) for r in rows)} runs"
              + ("" if not lagged else " (live latencies include host CPU starvation: compare "
                 "ratios, rerun those rows on a quieter machine)")
              + "".join(f"\n  {k}: {', '.join(v)}" for k, v in lagged.items()))  # fmt: skip
        return
    idle = [r for r in rows if r["idle_check"].startswith("IDLE")]
    print(
        f"idle pool while another queues (default): {len(idle)} rows"
        + "".join(f"\n  {r['workload']} @ {r['load']:.0%}: {r['idle_check']}" for r in idle)
    )


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="70%% load only, 7 policies, --span 16 --warmup 6"
    )
    p.add_argument("--live", action="store_true", help="live on the Llama pool of "
                   "examples/cluster.yaml (twins + gateway); 70%% load, 7 policies")  # fmt: skip
    p.add_argument("--live-requests", type=int, default=LIVE_REQUESTS,
                   help=f"--live: requests per run (default {LIVE_REQUESTS})")  # fmt: skip
    p.add_argument("--live-out", type=Path, default=LIVE_OUT,
                   help="--live: per-run reports and twin logs "
                        "(default runs/default-matrix-live)")  # fmt: skip
    p.add_argument("--workloads", help=f"comma list of {','.join(FAMILIES)}")
    p.add_argument("--policies", help="comma list (default: every shipped policy)")
    p.add_argument("--loads", help="comma list of fractions of capacity (default 0.5,0.7,0.9)")
    p.add_argument("--span", type=float, help="seconds of arrivals per run (default 24)")
    p.add_argument("--warmup", type=float, help="arrivals before this are not measured "
                   "(default 8; --live: the same share of its arrivals)")  # fmt: skip
    p.add_argument("--min-requests", type=int, help="lengthen a row's span to send at least "
                   "this many requests (same warmup share; default 3000, quick 1500)")  # fmt: skip
    p.add_argument("--model", help=f"served model or 'all' (default {MODEL}; not with --live)")
    p.add_argument("--cluster", type=Path, help=f"default {CLUSTER.relative_to(REPO)}; "
                   "not with --live")  # fmt: skip
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--traces-dir", type=Path)
    p.add_argument("--capacities", type=Path, help="JSON cache of the capacity searches")
    p.add_argument("--json", type=Path, help="write every run's key numbers here")
    p.add_argument("--default-params", type=json.loads, default=None,
                   help="JSON params of the default policy (not with --live)")  # fmt: skip
    args = p.parse_args(argv)  # fmt: skip
    args.span = args.span or (16.0 if args.quick else 24.0)
    args.min_requests = args.min_requests or (1500 if args.quick else 3000)
    args.warmup = args.warmup if args.warmup is not None else (6.0 if args.quick else 8.0)
    if not 0 <= args.warmup < args.span:
        p.error("need 0 <= --warmup < --span")
    if args.live and (args.model is not None or args.cluster is not None):
        p.error(f"--live runs the {LIVE_MODEL} pool of {LIVE_CLUSTER.relative_to(REPO)}; "
                "--model and --cluster are for the simulator")  # fmt: skip
    if args.live and args.default_params is not None:
        p.error("--default-params is for the simulator")
    if args.default_params is not None and not isinstance(args.default_params, dict):
        p.error("--default-params takes a JSON object")
    if args.live_requests < 1:
        p.error("need --live-requests >= 1")
    args.cluster = args.cluster or (LIVE_CLUSTER if args.live else CLUSTER)
    args.model = args.model or (LIVE_MODEL if args.live else MODEL)
    args.model = None if args.model == "all" else args.model
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    families = args.workloads.split(",") if args.workloads else list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(FAMILIES)}")
    shipped = [p for p in available_policies() if p not in SKIPPED]
    reduced = args.quick or args.live
    policies = (args.policies.split(",") if args.policies
                else list(QUICK_POLICIES if reduced else shipped))  # fmt: skip
    policies = [p for p in policies if p != "default"] + ["default"]
    loads = ([float(x) for x in args.loads.split(",")] if args.loads
             else list(QUICK_LOADS if reduced else LOADS))  # fmt: skip
    cluster = load_cluster_config(args.cluster)
    infos = describe_backends(cluster)
    if args.model is not None and args.model not in {i.model for i in infos}:
        raise SystemExit(f"no backend serves {args.model!r}: {sorted({i.model for i in infos})}")
    served = served_infos(infos, args.model)
    gpu_of = {i.name: i.gpu for i in served}
    live_cfg = llama_only(cluster) if args.live else None
    if live_cfg is not None:
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        events = all(b.kv_events_endpoint for b in live_cfg.backends)
        print(f"# default matrix --live: {cluster.name}, the {args.model} pool of "
              f"{args.cluster.relative_to(REPO)} ({len(served)} engine twins + the gateway on "
              f"127.0.0.1, {sum(i.tp for i in served)} GPUs: "
              f"{', '.join(sorted(set(gpu_of.values())))}; KV events "
              f"{'on' if events else 'off'}); reports in {args.live_out}")  # fmt: skip
    else:
        print(
            f"# default matrix: {cluster.name} ({len(infos)} backends, "
            f"{sum(i.tp for i in infos)} GPUs), model {args.model or 'all (by GPUs)'} "
            f"({len(served)} backends, {sum(i.tp for i in served)} GPUs: "
            f"{', '.join(sorted(set(gpu_of.values())))})"
        )
    print(
        f"# policies: {', '.join(policies)}; skipped: "
        + "; ".join(f"{k} ({v})" for k, v in SKIPPED.items())
    )
    if live_cfg is not None:
        print(f"# loads {', '.join(f'{x:.0%}' for x in loads)}; {args.live_requests} requests "
              f"per run, measured after the first {args.warmup / args.span:.0%} of its "
              f"arrivals; SLO ttft <= 2 s, tpot <= 100 ms; seed {args.seed}")  # fmt: skip
    else:
        print(f"# loads {', '.join(f'{x:.0%}' for x in loads)}; {args.span:g} s of arrivals per "
              f"run (longer for >= {args.min_requests} requests), measured after {args.warmup:g} s "
              f"(scaled alike); SLO ttft <= 2 s, tpot <= 100 ms; "
              f"seed {args.seed}")  # fmt: skip

    cache: dict[str, Any] = {}
    if args.capacities is not None and args.capacities.exists():
        cache = json.loads(args.capacities.read_text())
    print(
        "\n## Capacity: per backend line, the highest rate one replica keeps up with "
        "(finished >= 90% of arrived over the last 2/3 of >= 240 s of arrivals; bisected "
        "to 5%), x replicas"
    )
    if live_cfg is not None:
        print("(simulated: the twins run the simulator's engine model, so one simulated "
              "replica's capacity is a twin's)")  # fmt: skip
    capacities: dict[str, dict[str, Any]] = {}
    for name in families:
        cap = family_capacity(cluster, infos, FAMILIES[name], args, cache)
        capacities[name] = cap
        lines = ", ".join(f"{line} {b['rps']:.2f}/s x {b['replicas']}"
                          + ("" if b["is_bracketed"] else " (unbracketed)")
                          for line, b in cap["per_line"].items())  # fmt: skip
        print(f"{name:>13}: {cap['rps']:8.1f} req/s  ({lines})", flush=True)
        if args.capacities is not None:
            args.capacities.write_text(json.dumps(cache, indent=1))

    rows: list[dict[str, Any]] = []
    for name in families:
        family = FAMILIES[name]
        for load in loads:
            rate = load * capacities[name]["rps"]
            spec = family.spec
            if live_cfg is not None:
                spec = live_spec(family.spec, args.live_requests, len(live_cfg.backends))

                def make(spec: str = spec, rate: float = rate) -> Workload:
                    return load_workload(spec, seed=args.seed, num_requests=args.live_requests,
                                         rate=rate, traces_dir=args.traces_dir)  # fmt: skip

                span_s = max(r.arrival_s or 0.0 for r in make())
                warmup_s = span_s * args.warmup / args.span
                count = f" ({args.live_requests} requests)"
            else:
                span_s = max(args.span, args.min_requests / rate)
                warmup_s = args.warmup * span_s / args.span
                workload = load_workload(family.spec, seed=args.seed, duration_s=span_s,
                                         rate=rate, with_prompts=False,
                                         traces_dir=args.traces_dir)  # fmt: skip
                count = ""
            print(f"\n## {name} @ {load:.0%} = {rate:.1f} req/s for {span_s:.0f} s{count}, "
                  f"measured after {warmup_s:.0f} s ({spec}; {family.what})")  # fmt: skip
            print(block_header(live_cfg is not None))
            runs: dict[str, dict[str, Any]] = {}
            summaries: dict[str, Any] = {}
            records: dict[str, list[RequestRecord]] = {}
            out_dir = args.live_out / f"{name}-{round(load * 100)}"
            for policy in policies:
                if live_cfg is not None:
                    runs[policy], summaries[policy], records[policy] = run_live(
                        live_cfg, make, policy, gpu_of, span_s, warmup_s, out_dir, args
                    )
                    runs[policy]["idle_check"] = "n/a live"
                else:
                    runs[policy] = run_one(
                        cluster, workload, policy, gpu_of, span_s, warmup_s, args
                    )
                    runs[policy]["idle_check"] = idle_check(runs[policy])
                print(policy_line(runs[policy]), flush=True)
                if (notes := lag_line(runs[policy])) is not None:
                    print(notes, flush=True)
            if summaries:
                title = f"{name} @ {load:.0%}: " + " vs ".join(policies)
                write_comparison(out_dir, summaries, records=records, title=title, plot=False)
            row: dict[str, Any] = {"workload": name, "spec": spec, "load": load,
                                   "rate_rps": rate, "span_s": span_s,
                                   "warmup_s": warmup_s, "runs": runs}  # fmt: skip
            if "default" in runs and len(runs) > 1:
                row["worst"] = {m: worst(runs, m) for m in METRICS}
                row["verdict"] = verdict(row["worst"])
                row["idle_check"] = runs["default"]["idle_check"]
                print(f"  -> {row['verdict']}; idle check: {row['idle_check']}")
            rows.append(row)
            if args.json is not None:
                write_json(args, capacities, rows, policies, loads)
    judged = [r for r in rows if "verdict" in r]
    if judged:
        print_matrix(judged, live=live_cfg is not None)
    return 0


def write_json(
    args: argparse.Namespace, capacities: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
    policies: Sequence[str], loads: Sequence[float],
) -> None:  # fmt: skip
    data = {
        "cluster": str(args.cluster), "model": args.model or "all", "seed": args.seed,
        "span_s": args.span, "warmup_s": args.warmup, "slo": SLO.to_dict(),
        "policies": list(policies), "loads": list(loads), "skipped": SKIPPED,
        "capacity_method": "per backend line, the highest rate one replica keeps up with "
        "(finished >= 90% of arrived over the last 2/3 of >= 240 s of arrivals; bisected "
        "to 5%), x replicas",
        "capacities": capacities, "rows": rows,
    }  # fmt: skip
    if args.live:
        data |= {
            "live": True, "live_requests": args.live_requests, "live_out": str(args.live_out),
            "live_note": "engine twins + the real gateway on 127.0.0.1, a fresh cluster per "
            "policy; capacity simulated (the twins run the simulator's engine model); "
            "measured after the first span_s/warmup_s share of each run's arrivals; no busy "
            "fractions or queue times live (request_share, pool_ttft_p99_ms instead)",
        }  # fmt: skip
    args.json.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
