"""The doctor's pure rules, table-driven over synthetic snapshots (docs/doctor.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kiloserve.doctor.diagnose import (
    CAUSES,
    BackendFacts,
    EngineRead,
    Snapshot,
    diagnose,
    engine_read,
    facts_from_reads,
    gateway_counts,
    parse_prometheus,
)

M = "llama"


def _ok(name: str, model: str = M, **kw: Any) -> BackendFacts:
    """A healthy, lightly loaded backend."""
    base = BackendFacts(
        name=name, model=model, url=f"http://10.0.0.1:{8000 + int(name[-1])}",
        rtt_ms=1.0, running=2.0, waiting=0.0, kv_usage=0.2, waiting_delta=0.0,
        preemptions_delta=0.0, tokens_delta=300.0, engine_itl_ms=8.0, engine_ttft_ms=30.0,
        ewma_ttft_ms=35.0, ewma_tpot_ms=8.5, in_flight=2, attempts=20.0,
    )  # fmt: skip
    return replace(base, **kw)


def _snap(*backends: BackendFacts, queue: dict[str, float] | None = None) -> Snapshot:
    return Snapshot(gateway_url="http://gw", gateway_rtt_ms=1.0, window_s=1.0,
                    backends=backends, queue_depth=queue or {})  # fmt: skip


POOL = (_ok("a0"), _ok("a1"), _ok("a2"))

CASES: dict[str, tuple[Snapshot, str, str]] = {
    # name: (snapshot, expected top cause, expected top backend)
    "engine down": (
        _snap(_ok("a0", connect_ok=False, health_ok=False, metrics_ok=False, healthy=False,
                  unhealthy_reasons=("scrape",)), *POOL[1:]),
        "engine_down", "a0",
    ),
    "hung: health times out while TCP connects": (
        _snap(_ok("a0", health_ok=False, health_error="timeout", healthy=False,
                  unhealthy_reasons=("probe",), errors=5.0, attempts=5.0,
                  consecutive_errors=5, ejected=True), *POOL[1:]),
        "hung_engine", "a0",
    ),
    "hung: running but no token in the window": (
        _snap(_ok("a0", running=4.0, tokens_delta=0.0), *POOL[1:]),
        "hung_engine", "a0",
    ),
    "error burst": (
        _snap(*POOL[:2], _ok("a2", errors=10.0, attempts=20.0, consecutive_errors=2)),
        "error_burst", "a2",
    ),
    "error streak and ejection": (
        _snap(*POOL[:2], _ok("a2", errors=1.0, attempts=1.0, consecutive_errors=4, ejected=True)),
        "error_burst", "a2",
    ),
    "slow node: engine inter-token 4x the pool": (
        _snap(_ok("a0", engine_itl_ms=32.0, ewma_tpot_ms=33.0, demoted=True), *POOL[1:]),
        "slow_node", "a0",
    ),
    "slow node: only the gateway's EWMAs known": (
        _snap(*(replace(b, engine_itl_ms=None, engine_ttft_ms=None) for b in POOL[1:]),
              _ok("a0", engine_itl_ms=None, engine_ttft_ms=None, ewma_tpot_ms=40.0)),
        "slow_node", "a0",
    ),
    "slow node routed around: the engine's figures are its history (CI stop 33)": (
        # demoted, so no request reached it in the window: its engine means are its whole
        # history's (normal); the gateway's EWMAs are the window's evidence
        _snap(_ok("a0", engine_itl_ms=8.3, engine_ttft_ms=27.0, engine_in_window=False,
                  ewma_tpot_ms=32.0, ewma_ttft_ms=58.0, demoted=True, attempts=0.0),
              *POOL[1:]),
        "slow_node", "a0",
    ),
    "network delay: round trip high, engine normal": (
        _snap(*POOL[:2], _ok("a2", rtt_ms=120.0, ewma_ttft_ms=150.0)),
        "network_delay", "a2",
    ),
    "kv saturation": (
        _snap(*POOL[:2], _ok("a2", kv_usage=0.97, preemptions_delta=3.0, waiting=5.0,
                             waiting_delta=2.0)),
        "kv_saturation", "a2",
    ),
    "kv at 0.89 but preempting": (
        _snap(*POOL[:2], _ok("a2", kv_usage=0.89, preemptions_delta=2.0)),
        "kv_saturation", "a2",
    ),
    "queue build-up across the pool": (
        _snap(*(replace(b, waiting=12.0) for b in POOL), queue={M: 30.0}),
        "queue_buildup", f"pool {M}",
    ),
    "one pool short while another idles": (
        _snap(*(replace(b, waiting=5.0) for b in POOL[:2]),
              _ok("b0", model="qwen", running=0.0, in_flight=0, waiting=0.0),
              _ok("b1", model="qwen", running=0.0, in_flight=0, waiting=0.0)),
        "pool_short", f"pool {M}",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_top_finding(case: str) -> None:
    snap, cause, backend = CASES[case]
    findings = diagnose(snap)
    assert findings, case
    top = findings[0]
    assert (top.cause, top.backend) == (cause, backend), findings
    assert 0.0 < top.score <= 1.0
    assert top.evidence and top.advice == CAUSES[cause]


def test_healthy_pool_has_no_finding() -> None:
    assert diagnose(_snap(*POOL)) == []
    assert diagnose(_snap()) == []


def test_findings_are_ranked_by_score() -> None:
    snap = _snap(
        _ok("a0", health_ok=False, health_error="timeout"),
        _ok("a1", engine_itl_ms=30.0),
        _ok("a2", errors=4.0, attempts=20.0),
        _ok("a3"),
    )
    findings = diagnose(snap)
    scores = [f.score for f in findings]
    assert scores == sorted(scores, reverse=True)
    assert findings[0].cause == "hung_engine"
    assert {f.cause for f in findings} >= {"hung_engine", "slow_node", "error_burst"}


def test_errors_of_a_hung_engine_rank_below_the_hang() -> None:
    hung = _ok("a0", health_ok=False, errors=9.0, attempts=9.0, consecutive_errors=9)
    findings = diagnose(_snap(hung, *POOL[1:]))
    assert [f.cause for f in findings] == ["hung_engine", "error_burst"]
    assert "symptom" in findings[1].evidence


def test_an_idle_pools_old_ewmas_are_not_a_slow_node() -> None:
    # no request reached any engine in the window: a backend's slow EWMA is as old as the
    # engines' history (normal), so nothing is found; demoted, the gateway's view counts
    idle = tuple(replace(b, engine_in_window=False, attempts=0.0) for b in POOL)
    stale = replace(idle[0], ewma_tpot_ms=32.0)
    assert diagnose(_snap(stale, *idle[1:])) == []
    (finding,) = diagnose(_snap(replace(stale, demoted=True), *idle[1:]))
    assert (finding.cause, finding.backend) == ("slow_node", "a0")
    assert "demoted by the gateway" in finding.evidence


def test_slow_engine_is_not_called_network() -> None:
    slow = _ok("a2", rtt_ms=120.0, engine_itl_ms=40.0)
    assert [f.cause for f in diagnose(_snap(*POOL[:2], slow))] == ["slow_node"]


def test_small_round_trips_are_not_network_delay() -> None:
    # 3x the pool's median but under the 30 ms floor
    assert diagnose(_snap(*POOL[:2], _ok("a2", rtt_ms=9.0))) == []


def test_stale_error_streak_is_weak() -> None:
    stale = _ok("a2", consecutive_errors=8, errors=0.0, attempts=0.0)
    (finding,) = diagnose(_snap(*POOL[:2], stale))
    assert finding.cause == "error_burst" and finding.score < 0.5


def test_a_backend_held_out_for_5xx_probes_is_an_error_burst() -> None:
    # the gateway's completion probe got a 500 and holds it out: no request of its own in
    # the window, no ejection, no streak; the probe's answer is the evidence (CI stop 25)
    held = _ok("a2", healthy=False, unhealthy_reasons=("probe",), errors=0.0, attempts=0.0,
               probe_failure="completion http 500")  # fmt: skip
    (finding,) = diagnose(_snap(*POOL[:2], held))
    assert (finding.cause, finding.backend) == ("error_burst", "a2")
    assert "completion http 500" in finding.evidence and finding.score >= 0.7


@pytest.mark.parametrize("why", ["completion timeout", "health http 404", "connect refused"])
def test_other_probe_failures_are_not_error_bursts(why: str) -> None:
    held = _ok("a2", healthy=False, unhealthy_reasons=("probe",), probe_failure=why)
    assert "error_burst" not in {f.cause for f in diagnose(_snap(*POOL[:2], held))}


def test_as_dict_keys() -> None:
    snap, _, _ = CASES["error burst"]
    assert set(diagnose(snap)[0].as_dict()) == {"cause", "backend", "score", "evidence", "advice"}


ENGINE_PAGE = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.2
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
"""


def test_parse_prometheus_labels_and_values() -> None:
    samples = parse_prometheus('a{x="1",y="b c"} 2.5\n# c\nb 3\nbad line\n')
    assert samples == [("a", {"x": "1", "y": "b c"}, 2.5), ("b", {}, 3.0)]


def test_engine_read() -> None:
    r = engine_read(ENGINE_PAGE)
    assert (r.running, r.waiting, r.kv_usage, r.preemptions) == (3.0, 2.0, 0.5, 7.0)
    assert (r.generation_tokens, r.ttft_count, r.itl_sum) == (1000.0, 4.0, 1.0)


def test_facts_from_reads_takes_window_deltas() -> None:
    first = engine_read(ENGINE_PAGE)
    last = replace(first, generation_tokens=1300.0, preemptions=9.0, itl_sum=2.0,
                   itl_count=120.0, waiting=5.0)  # fmt: skip
    gw0 = gateway_counts(
        'kiloserve_gateway_requests_total{backend="a0",model="m",status="200"} 10\n'
    )
    gw1 = gateway_counts(
        'kiloserve_gateway_requests_total{backend="a0",model="m",status="200"} 14\n'
        'kiloserve_gateway_requests_total{backend="a0",model="m",status="503"} 6\n'
        'kiloserve_gateway_backend_ejected{backend="a0"} 1.0\n'
        'kiloserve_gateway_queue_depth{lane="short",model="m"} 3\n'
    )
    row = {"name": "a0", "url": "http://x:1", "models": ["m"], "healthy": True,
           "consecutive_errors": 2, "ewma_tpot_ms": 9.0, "in_flight": 3}  # fmt: skip
    f = facts_from_reads(row, first=first, last=last, gw_first=gw0, gw_last=gw1,
                         connect_ok=True, health_ok=True, health_error="", rtt_ms=1.5)  # fmt: skip
    assert (f.attempts, f.errors, f.ejected) == (10.0, 6.0, True)
    assert (f.tokens_delta, f.preemptions_delta, f.waiting_delta) == (300.0, 2.0, 3.0)
    assert f.engine_itl_ms == pytest.approx(50.0)  # 1 s over 20 new gaps
    assert f.engine_ttft_ms == pytest.approx(50.0)  # no new sample: the whole history
    assert f.engine_in_window  # new inter-token samples
    idle = facts_from_reads(
        row, first=first, last=first, gw_first=gw0, gw_last=gw0,
        connect_ok=True, health_ok=True, health_error="", rtt_ms=1.5,
    )  # fmt: skip
    assert idle.engine_itl_ms == pytest.approx(1000.0 / 100) and not idle.engine_in_window
    assert gw1["queue"] == {"m": 3.0}


def test_an_ejection_that_ended_inside_the_window_still_counts() -> None:
    """Ejected at the first read, or ejected and back (its half-open trial passed) between
    the two reads: the window's evidence of an error burst is the ejection itself."""
    page = ENGINE_PAGE
    row = {"name": "a0", "models": ["m"]}
    ejected = 'kiloserve_gateway_backend_ejected{backend="a0"} 1.0\n'
    count = 'kiloserve_gateway_outlier_ejections_total{backend="a0"} %d\n'
    cases = [(ejected + count % 1, count % 1), (count % 1, count % 2), (count % 1, count % 1)]
    got = []
    for a, b in cases:
        read = engine_read(page)
        f = facts_from_reads(
            row, first=read, last=read, gw_first=gateway_counts(a), gw_last=gateway_counts(b),
            connect_ok=True, health_ok=True, health_error="", rtt_ms=1.0,
        )  # fmt: skip
        got.append(f.ejected)
    assert got == [True, True, False]


def test_facts_from_failed_reads_are_unknown() -> None:
    bad = EngineRead(ok=False, error="timeout")
    gw = gateway_counts("")
    f = facts_from_reads(
        {"name": "a0"}, first=bad, last=bad, gw_first=gw, gw_last=gw,
        connect_ok=True, health_ok=False, health_error="timeout", rtt_ms=None,
    )  # fmt: skip
    assert not f.metrics_ok and f.running is None and f.engine_itl_ms is None
    assert diagnose(_snap(f, *POOL[1:]))[0].cause == "hung_engine"


def test_a_flag_any_worker_sets_counts() -> None:
    """``--workers N``: one ``backend_ejected`` series per worker; the backend is
    ejected when any worker says so, whichever series the page lists last."""
    gw = gateway_counts(
        'kiloserve_gateway_backend_ejected{backend="a0",worker="0"} 1.0\n'
        'kiloserve_gateway_backend_ejected{backend="a0",worker="1"} 0.0\n'
    )
    assert gw["flags"] == {"a0": {"ejected": True}}
