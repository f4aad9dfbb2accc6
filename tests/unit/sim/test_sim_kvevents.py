"""KV-cache events in the simulator: simulated engines feed the gateway's exact index
through the live gateway's feed code, and routing uses it (issue 14)."""

from __future__ import annotations

from typing import Any

from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.sim import parse_fault, simulate
from kiloserve.workload import load_workload

# 20 tenants, each a 2,000-token system prompt, short unique user turns
SPEC = "synthetic:input=uniform(64,128),output=uniform(20,40),prefix_groups=20,prefix_tokens=2000"


def _cluster(kv_events: bool) -> ClusterConfig:
    line: dict[str, Any] = {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 4}
    if kv_events:
        line["kv_events_endpoint"] = "auto"
    return parse_cluster_config({"backends": [line]})


def _run(kv_events: bool, **kw: Any) -> dict[str, Any]:
    workload = load_workload(SPEC, seed=3, rate=20, num_requests=300, with_prompts=False)
    return simulate(_cluster(kv_events), workload, "default", seed=3, **kw).summary


def test_engines_publish_into_the_gateways_exact_index() -> None:
    summary = _run(True)
    kv = summary["kv_events"]
    assert kv["publishers"] == 4 and kv["exact"] == 4
    assert kv["events"] > 0 and kv["index_blocks"] > 0
    # the engines' own counters: most prompt tokens are the tenants' shared heads
    assert summary["prefix_cache"]["hit_rate"] > 0.7
    assert set(summary["pools"]) == {"H100-SXM"}
    assert 0.0 < summary["pools"]["H100-SXM"]["busy_fraction"] <= 1.0


def test_without_kv_events_nothing_is_published() -> None:
    summary = _run(False)
    assert summary["kv_events"] == {
        "publishers": 0, "exact": 0, "batches": 0, "events": 0, "index_blocks": 0
    }  # fmt: skip
    assert summary["prefix_cache"]["hit_rate"] > 0.5  # the approximate index still works


def test_a_dead_engine_loses_its_entries_and_publishes_again_after_recovery() -> None:
    died = _run(True, faults=[parse_fault("t=3,backend=h100-0,kind=die")])
    assert died["kv_events"]["exact"] == 3  # h100-0's feed was lost and stays lost
    back = _run(
        True,
        faults=[
            parse_fault("t=3,backend=h100-0,kind=die"),
            parse_fault("t=5,backend=h100-0,kind=recover"),
        ],
    )
    assert back["kv_events"]["exact"] == 4  # the fresh engine numbers from 0 again
