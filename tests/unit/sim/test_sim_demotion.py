"""Slow-node demotion in the simulator: the gateway's demoter, fed by simulated
attempts, cuts a slowed backend's weight to 20% and its share of requests with it."""

from __future__ import annotations

from typing import Any

from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.sim import SimResult, parse_fault, simulate
from kiloserve.workload import load_workload

SPEC = "synthetic:input=uniform(64,256),output=uniform(100,200)"


def _cluster(demotion: dict[str, Any] | None = None) -> ClusterConfig:
    gateway: dict[str, Any] = {"policy": "least_request"}
    if demotion is not None:
        gateway["options"] = {"demotion": demotion}
    backend = {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 6}
    return parse_cluster_config({"gateway": gateway, "backends": [backend]})


def _run(cluster: ClusterConfig) -> SimResult:
    workload = load_workload(SPEC, seed=3, rate=30, num_requests=1200, with_prompts=False)
    fault = parse_fault("t=0,backend=h100-0,kind=slow,factor=5")
    return simulate(cluster, workload, "least_request", faults=[fault], keep_records=True)


def _share_after(result: SimResult, backend: str, start_s: float) -> float:
    late = [r for r in result.records if r.start_s >= start_s]
    return sum(1 for r in late if r.backend == backend) / len(late)


def test_a_slow_backend_is_demoted_and_loses_traffic() -> None:
    on, off = _run(_cluster()), _run(_cluster({"enabled": False}))
    assert on.summary["demotions"] == {"enabled": True, "by_backend": {"h100-0": 1}}
    assert off.summary["demotions"] == {"enabled": False, "by_backend": {}}
    share_on, share_off = _share_after(on, "h100-0", 10.0), _share_after(off, "h100-0", 10.0)
    # least_request alone already sends it less than 1/6; demotion divides that by ~5
    assert share_off < 1 / 6
    assert share_on < share_off / 2
    tpot_on, tpot_off = on.summary["tpot_ms"]["p99"], off.summary["tpot_ms"]["p99"]
    assert tpot_on < tpot_off


def test_identical_backends_are_not_demoted() -> None:
    workload = load_workload(SPEC, seed=3, rate=30, num_requests=600, with_prompts=False)
    result = simulate(_cluster(), workload, "least_request")
    assert result.summary["demotions"] == {"enabled": True, "by_backend": {}}
