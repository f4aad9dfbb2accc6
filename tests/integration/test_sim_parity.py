"""Parity: the same workload through a live twin cluster + gateway and through the
simulator, on the same cluster YAML.

Round robin must route the identical sequence; P50 / P95 TTFT and TPOT and the
request throughput must agree within 10% at a low, non-saturating rate.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from pathlib import Path

import pytest

from kiloserve.bench.client import run_bench
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.results.metrics import summarize
from kiloserve.sim import simulate
from kiloserve.workload import OpenLoop, Workload, load_workload

MODEL = "Llama-3.1-8B"
WORKLOAD = "synthetic:input=uniform(256,1024),output=uniform(48,128)"
RATE = 3.0
NUM_REQUESTS = 45
TOLERANCE = 0.10
# The loopback HTTP path (client -> gateway -> twin and back, aiohttp on both hops) is
# the live cluster's "network": its delay is measured with a few tiny requests after
# the run, on warm connections (live TTFT minus simulated TTFT at zero delay, halved).
PROBE = "synthetic:input=32,output=2"
DISTORTED = "live client distorted"
REORDER_S = 0.005  # sends closer than this may swap on the way to the gateway
NUM_PROBES = 8  # even: half on each backend, live (sent after the run) and simulated

pytestmark = pytest.mark.timeout(120)


def _cluster() -> ClusterConfig:
    return parse_cluster_config(
        {
            "name": "parity",
            "gateway": {"port": 0, "policy": "round_robin"},
            "backends": [
                {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b"},
                {"name": "a100", "gpu": "A100", "model": "llama-3.1-8b"},
            ],
        }
    )


def _workload(with_prompts: bool) -> Workload:
    return load_workload(
        WORKLOAD, seed=3, rate=RATE, num_requests=NUM_REQUESTS, with_prompts=with_prompts
    )


def _probe(with_prompts: bool) -> Workload:
    return load_workload(PROBE, seed=99, rate=4.0, num_requests=NUM_PROBES,
                         with_prompts=with_prompts)  # fmt: skip


def _live(
    cfg: ClusterConfig, run_dir: Path
) -> tuple[dict[str, object], list[tuple[float, str]], float]:
    """(summary, routing sequence, probes' median TTFT in s) from the live cluster."""
    cluster = LocalCluster(
        cfg, gateway=True, policy="round_robin", gateway_port=0, run_dir=run_dir,
        gateway_options={"seed": 0, "workers": 1},  # the simulator models one router
    )  # fmt: skip
    with cluster:
        url = cluster.gateway_url
        assert url is not None
        result = asyncio.run(run_bench(url, MODEL, _workload(True), OpenLoop()))
        probes = asyncio.run(run_bench(url, MODEL, _probe(True), OpenLoop()))  # warm now
    records = sorted(result.records, key=lambda r: r.start_s)
    routing = [(r.start_s, r.backend or "?") for r in records]
    probe_ttft_s = statistics.median(r.ttft_s or 0.0 for r in probes.records)
    return summarize(result), routing, probe_ttft_s


def _same_routing(sim: list[str], live: list[tuple[float, str]]) -> bool:
    """Sim's routing equals the live one, except that requests the client sent within
    ``REORDER_S`` of each other may reach the gateway in either order (loopback
    scheduling), so within such a burst the backends are compared as multisets."""
    if len(sim) != len(live):
        return False
    start = 0
    for i in range(1, len(live) + 1):
        if i == len(live) or live[i][0] - live[i - 1][0] > REORDER_S:
            if sorted(sim[start:i]) != sorted(b for _, b in live[start:i]):
                return False
            start = i
    return True


def _network_delay_s(cfg: ClusterConfig, live_probe_ttft_s: float) -> float:
    sim = simulate(cfg, _probe(False), "round_robin", model=MODEL, network_delay_s=0.0)
    sim_ttft_ms = sim.summary["ttft_ms"]["p50"]  # type: ignore[index]
    return max(0.0, (live_probe_ttft_s - sim_ttft_ms / 1000.0) / 2.0)


def _close(sim: float, live: float) -> bool:
    return abs(sim - live) <= TOLERANCE * live


def _compare(cfg: ClusterConfig, run_dir: Path) -> list[str]:
    """One live run against the simulation: asserts routing, returns latency mismatches."""
    live, live_routing, probe_ttft_s = _live(cfg, run_dir)
    delay_s = _network_delay_s(cfg, probe_ttft_s)
    assert delay_s < 0.02, f"loopback delay {delay_s * 1000:.1f} ms: the machine is overloaded"
    result = simulate(
        cfg, _workload(False), "round_robin", keep_records=True, model=MODEL,
        network_delay_s=delay_s,
    )  # fmt: skip
    sim = result.summary
    assert live["requests_ok"] == sim["requests_ok"] == NUM_REQUESTS
    sim_routing = [backend for _, backend in result.routing]
    assert _same_routing(sim_routing, live_routing), (sim_routing, live_routing)
    report = [f"measured one-way loopback delay: {delay_s * 1000:.2f} ms"]
    mismatches = []
    for key in ("ttft_ms", "tpot_ms"):
        for stat in ("p50", "p95"):
            live_v, sim_v = live[key][stat], sim[key][stat]  # type: ignore[index]
            report.append(f"{key}.{stat}: live {live_v:.1f} sim {sim_v:.1f}")
            if not _close(sim_v, live_v):
                mismatches.append(report[-1])
    live_thr, sim_thr = live["request_throughput"], sim["request_throughput"]
    report.append(f"throughput: live {live_thr:.3f} sim {sim_thr:.3f}")
    if not _close(float(sim_thr), float(live_thr)):  # type: ignore[arg-type]
        mismatches.append(report[-1])
    if mismatches and live.get("client_warning"):  # bench's validity check: client starved
        mismatches.append(f"{DISTORTED}: {live['client_warning']}")
    print("\n".join(report))
    return mismatches


def test_sim_matches_live_twin_cluster(tmp_path: Path) -> None:
    # The live side runs in real time on a shared machine: a burst of other load can
    # starve its processes for a whole run (seen: TTFT P50 +30%, and +12% in two runs
    # in a row on a quiet-looking box, 6% and 2% minutes later). A latency mismatch is
    # therefore measured again on a fresh cluster, up to twice; routing is never retried.
    cfg = _cluster()
    mismatches = _compare(cfg, tmp_path / "logs-1")
    for attempt in (2, 3):
        if not mismatches:
            break
        print("latency mismatch, measuring the live cluster once more:", mismatches)
        mismatches = _compare(cfg, tmp_path / f"logs-{attempt}")
    if any(m.startswith(DISTORTED) for m in mismatches):
        pytest.skip(f"live latencies invalid twice by bench's own check: {mismatches}")
    load_1m, num_cpus = os.getloadavg()[0], os.cpu_count() or 1
    if mismatches and load_1m > num_cpus:
        # Other jobs own the cores: the live side's latencies are the scheduler's, not
        # the model's. Routing (asserted above) does not depend on that.
        pytest.skip(f"load average {load_1m:.1f} > {num_cpus} cores: {mismatches}")
    assert not mismatches, "; ".join(mismatches)
