"""The Mooncake conversation trace (real shared prefixes): exact prefix routing (KV
events) vs today's approximate index vs round robin vs least request.

    .venv/bin/python benchmarks/mooncake_routing.py                      # ~1.5 min: the simulator
    .venv/bin/python benchmarks/mooncake_routing.py --live-budget 600    # + the live part, ~9 min

1. Simulator (deterministic, independent of machine load): ``examples/cluster-1024.yaml``
   (368 backends, 1,024 GPUs, KV events on every line), every request to its main pool
   (``--model`` Llama-3.1-70B: 160 x TP4 H100 + 48 x TP4 A100; ``--model all`` draws a
   pool per request by GPU count, which splits a conversation's turns over models), the
   shipped Mooncake trace (``hash_ids`` = shared 512-token blocks; its first
   ``--num-requests`` 4,000) rescaled to ``--rate`` 100 requests/s (the trace's own
   3.4/s leaves the cluster idle). Rows: ``default`` and ``prefix_affinity`` with KV
   events on (the exact index) and off (the config with the ``kv_events_*`` keys
   removed: today's approximate index, what the gateway sent where), ``round_robin``,
   ``least_request``; and the hit rate of an oracle (one infinite cache).
2. Live: ``examples/cluster.yaml``'s Llama pool (2 x H100, 2 x A100, 1 x L40S twins)
   replaying the first ``--live-requests`` Mooncake requests
   at ``--live-rate``, each policy on a freshly started cluster: ``default`` with KV
   events on; ``round_robin``, ``least_request`` and ``prefix_affinity`` with them off.
   Skipped with a note when the estimated time exceeds ``--live-budget`` (360) seconds,
   as it does by default (``--no-live`` / ``--no-sim`` skip a part). Its hit rates tell
   little: the first 100 requests share almost nothing but Mooncake's common first
   block (the oracle's hit rate is 0.033).

Prints per row the prefix-cache hit rate (the engines' own counters: tokens hit /
tokens queried; live, deltas of ``vllm:prefix_cache_*_total`` summed over the twins),
TTFT P50/P99, E2E P99 and throughput, then the default's ratios to the others.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from prefix_routing import kv_events_line, one_run  # noqa: E402
from routing_quality import llama_only  # noqa: E402

from kiloserve.launch.cluster import LocalCluster  # noqa: E402
from kiloserve.launch.config import ClusterConfig, load_cluster_config  # noqa: E402
from kiloserve.results.metrics import summarize  # noqa: E402
from kiloserve.results.report import write_report  # noqa: E402
from kiloserve.sim import simulate  # noqa: E402
from kiloserve.workload import Workload, load_workload, read_trace  # noqa: E402
from kiloserve.workload.prompts import BLOCK_TOKENS  # noqa: E402

# (label, policy, KV events on)
SIM_ROWS = (
    ("default (events on)", "default", True),
    ("default (events off)", "default", False),
    ("prefix_affinity (events on)", "prefix_affinity", True),
    ("prefix_affinity (events off)", "prefix_affinity", False),
    ("round_robin", "round_robin", False),
    ("least_request", "least_request", False),
)
LIVE_ROWS = (
    ("default (events on)", "default", True),
    ("round_robin", "round_robin", False),
    ("least_request", "least_request", False),
    ("prefix_affinity (events off)", "prefix_affinity", False),
)
LIVE_MODEL = "Llama-3.1-8B"


def without_kv_events(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with every backend's ``kv_events_*`` keys removed (approximate index)."""
    off = {"kv_events_endpoint": None, "kv_events_replay_endpoint": None}
    return cfg.model_copy(update={"backends": [b.model_copy(update=off) for b in cfg.backends]})


def with_options(cfg: ClusterConfig, args: argparse.Namespace) -> ClusterConfig:
    """``cfg`` with ``--max-prefix-tokens`` among its gateway options, if given."""
    if args.max_prefix_tokens is None:
        return cfg
    options = {**cfg.gateway.options, "max_prefix_tokens": args.max_prefix_tokens}
    return cfg.model_copy(update={"gateway": cfg.gateway.model_copy(update={"options": options})})


def header() -> str:
    return (f"| {'row':<28} | hit rate | TTFT P50 | TTFT P99 | E2E P99 | req/s | failed |\n"
            f"|{'-' * 30}|---|---|---|---|---|---|")  # fmt: skip


def row(label: str, s: dict[str, Any], hit: float | None) -> str:
    t, e = s["ttft_ms"], s["e2e_ms"]
    h = "-" if hit is None else f"{hit:.3f}"
    return (f"| {label:<28} | {h} | {t['p50']:.0f} | {t['p99']:.0f} | {e['p99']:.0f} | "
            f"{s['request_throughput']:.2f} | {s['requests_failed']} |")  # fmt: skip


def ratios(results: dict[str, tuple[dict[str, Any], float | None]]) -> None:
    d, d_hit = results["default (events on)"]
    for label, (s, hit) in results.items():
        if label == "default (events on)":
            continue
        p50 = d["ttft_ms"]["p50"] / s["ttft_ms"]["p50"]
        p99 = d["ttft_ms"]["p99"] / s["ttft_ms"]["p99"]
        dh = "" if hit is None or d_hit is None else f"; hit rate {d_hit - hit:+.3f}"
        print(f"default (events on) / {label:<28}: TTFT P50 {p50:.2f}x, P99 {p99:.2f}x{dh}")


def oracle_hit_rate(num_requests: int, traces_dir: Path | None) -> float:
    """Hit rate of one infinite cache that every request reaches: a request hits the
    longest run of leading ``hash_ids`` blocks some earlier request had (512 tokens each,
    at most all but the last prompt token, in whole 16-token blocks); an upper bound."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for row in read_trace("mooncake", traces_dir)[:num_requests]:
        depth = 0
        while depth < len(row.hash_ids) and row.hash_ids[: depth + 1] in seen:
            depth += 1
        seen.update(row.hash_ids[: k + 1] for k in range(len(row.hash_ids)))
        hits += min(depth * BLOCK_TOKENS, (row.input_tokens - 1) // 16 * 16)
        total += row.input_tokens
    return hits / total


def run_sim(args: argparse.Namespace) -> None:
    cfg_on = with_options(load_cluster_config(REPO / "examples" / "cluster-1024.yaml"), args)
    cfg_off = without_kv_events(cfg_on)
    num_gpus = sum(b.count * b.tp for b in cfg_on.backends)

    def workload() -> Workload:
        return load_workload("mooncake", seed=args.seed, rate=args.rate,
                             num_requests=args.num_requests, traces_dir=args.traces_dir,
                             with_prompts=False)  # fmt: skip

    n = workload().num_requests
    print(f"## Simulator: {cfg_on.name} ({len(cfg_on.expanded())} backends, {num_gpus} GPUs), "
          f"model {args.model}, Mooncake {n} requests at {args.rate} req/s, "
          f"seed {args.seed}")  # fmt: skip
    print(f"oracle (one infinite cache every request reaches): hit rate "
          f"{oracle_hit_rate(n or 0, args.traces_dir):.3f}\n")  # fmt: skip
    print(header(), flush=True)
    results: dict[str, tuple[dict[str, Any], float | None]] = {}
    for label, policy, events in SIM_ROWS:
        started = time.monotonic()
        cfg = cfg_on if events else cfg_off
        s = simulate(cfg, workload(), policy, seed=args.seed, traces_dir=args.traces_dir,
                     model=None if args.model == "all" else args.model).summary  # fmt: skip
        hit = s["prefix_cache"]["hit_rate"]
        results[label] = (s, hit)
        busy = ", ".join(f"{g} {p['busy_fraction']:.2f}" for g, p in s["pools"].items())
        kv = s["kv_events"]
        print(row(label, s, hit) + f"  <!-- {time.monotonic() - started:.0f} s; busy {busy}; "
              f"kv feeds exact {kv['exact']}/{kv['publishers']} -->", flush=True)  # fmt: skip
    print()
    ratios(results)


def run_live(args: argparse.Namespace) -> None:
    base = with_options(llama_only(load_cluster_config(REPO / "examples" / "cluster.yaml")), args)
    # per run: the arrivals, then ~60 s of start-up and drain (measured: the first 100
    # requests hold a 120k-token prompt that round robin queues others behind)
    estimate_s = len(LIVE_ROWS) * (args.live_requests / args.live_rate + 60)
    print(f"\n## Live: {base.name} Llama pool ({len(base.expanded())} twins), the first "
          f"{args.live_requests} Mooncake requests at {args.live_rate} req/s; estimated "
          f"{estimate_s / 60:.1f} min")  # fmt: skip
    if estimate_s > args.live_budget:
        print(f"skipped: over --live-budget {args.live_budget:.0f} s (--live-budget 600 runs "
              f"it: ~9 min on the shared 2-core box)")  # fmt: skip
        return
    print(f"oracle (one infinite cache every request reaches): hit rate "
          f"{oracle_hit_rate(args.live_requests, args.traces_dir):.3f}")  # fmt: skip
    workload = load_workload(
        "mooncake", seed=args.seed, rate=args.live_rate, num_requests=args.live_requests,
        traces_dir=args.traces_dir,
    )  # fmt: skip
    print("\n" + header(), flush=True)
    results: dict[str, tuple[dict[str, Any], float | None]] = {}
    notes: list[str] = []
    for label, policy, events in LIVE_ROWS:
        cfg = base if events else without_kv_events(base)
        out_dir = args.out / "live" / policy
        cluster = LocalCluster(cfg, gateway=True, policy=policy, gateway_port=0,
                               run_dir=out_dir / "logs",
                               gateway_options={"seed": args.seed, "workers": 1},  # one process
                               start_timeout_s=120)  # fmt: skip
        with cluster:
            out = asyncio.run(one_run(cluster, LIVE_MODEL, workload, events))
        s = summarize(out["result"], None)
        write_report(out_dir, out["result"], s, plot=False)
        hit = out["hits"] / out["queries"] if out["queries"] else None
        results[label] = (s, hit)
        print(row(label, s, hit), flush=True)
        notes.append(f"{label}: wall {out['wall_s']:.0f} s; {kv_events_line(out['kv_events'])}")
    print()
    for note in notes:
        print(note)
    ratios(results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="sim: requests/s (trace: 3.4)")
    p.add_argument("--num-requests", type=int, default=4000, help="sim: first N requests")
    p.add_argument("--model", default="Llama-3.1-70B",
                   help="sim: the served model every request goes to ('all': spread over the "
                        "pools by GPU count)")  # fmt: skip
    p.add_argument("--no-live", action="store_true", help="skip the live twin part")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator part")
    p.add_argument("--max-prefix-tokens", type=int, help="gateway option (default 2048)")
    p.add_argument("--live-requests", type=int, default=100)
    p.add_argument("--live-rate", type=float, default=1.5, help="requests/s")
    p.add_argument(
        "--live-budget", type=float, default=360.0, help="s; a longer live part is skipped"
    )
    p.add_argument("--traces-dir", type=Path, help="default: the packaged traces")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "mooncake-routing")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if not args.no_sim:
        run_sim(args)
    if not args.no_live:
        run_live(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
