"""Fast-forwarded decode runs give exactly what stepping one step at a time gives."""

from __future__ import annotations

import pytest

from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.sim import SimResult, simulate
from kiloserve.sim.faults import parse_fault
from kiloserve.workload import load_workload


def _cluster(max_num_seqs: int | None = None) -> ClusterConfig:
    extra = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    return parse_cluster_config(
        {
            "backends": [
                {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", **extra},
                {"name": "l40s", "gpu": "L40S", "model": "llama-3.1-8b", "count": 2, **extra},
            ]
        }
    )


def _both(cluster: ClusterConfig, spec: str, rate: float, policy: str, **kw: object) -> tuple[
    SimResult, SimResult
]:  # fmt: skip
    out = []
    for fast_forward in (True, False):
        workload = load_workload(spec, seed=5, rate=rate, num_requests=120, with_prompts=False)
        out.append(
            simulate(cluster, workload, policy, keep_records=True, fast_forward=fast_forward,
                     **kw)  # type: ignore[arg-type]
        )  # fmt: skip
    return out[0], out[1]


def _assert_same(fused: SimResult, single: SimResult) -> None:
    assert fused.summary["sim_stats"]["num_fused_steps"] > 0
    assert single.summary["sim_stats"]["num_fused_steps"] == 0
    assert fused.summary["sim_stats"]["num_steps"] == single.summary["sim_stats"]["num_steps"]
    assert fused.routing == single.routing
    assert len(fused.records) == len(single.records)
    by_id = {r.request_id: r for r in single.records}
    for r in fused.records:
        other = by_id[r.request_id]
        assert (r.is_ok, r.backend, r.output_tokens) == (other.is_ok, other.backend,
                                                         other.output_tokens)  # fmt: skip
        for a, b in ((r.ttft_s, other.ttft_s), (r.e2e_s, other.e2e_s)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a == pytest.approx(b, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("policy", ["round_robin", "least_request", "least_tokens"])
def test_fast_forward_equals_single_steps(policy: str) -> None:
    spec = "synthetic:input=uniform(32,400),output=uniform(20,300)"
    fused, single = _both(_cluster(), spec, rate=25, policy=policy)
    _assert_same(fused, single)
    assert fused.summary["requests_ok"] == 120


def test_fast_forward_equals_single_steps_with_queueing_and_prefix_hits() -> None:
    spec = (
        "synthetic:input=uniform(16,300),output=uniform(50,200),prefix_groups=3,prefix_tokens=128"
    )
    fused, single = _both(_cluster(max_num_seqs=4), spec, rate=60, policy="round_robin")
    _assert_same(fused, single)
    # the cap of 4 sequences really queued requests: TTFT far above a lone prefill
    assert fused.summary["ttft_ms"]["p95"] > 500  # type: ignore[index]


def test_fast_forward_equals_single_steps_through_faults() -> None:
    faults = [
        parse_fault("t=1.0,backend=l40s-0,kind=slow,factor=3"),
        parse_fault("t=2.0,backend=h100,kind=die"),
        parse_fault("t=3.5,backend=h100,kind=recover"),
    ]
    spec = "synthetic:input=uniform(32,400),output=uniform(20,300)"
    fused, single = _both(_cluster(), spec, rate=25, policy="round_robin", faults=faults)
    _assert_same(fused, single)
    assert fused.summary["requests_failed"] > 0  # streams on h100 were cut
