"""The workers' dashboard documents merged into the gateway's (``dashboard_merge``)."""

from __future__ import annotations

from typing import Any

from kiloserve.gateway.dashboard_merge import merge_states


def _doc(
    in_flight: int,
    req: float,
    series: list[float],
    latency: dict[str, list[float | None]],
    decisions: list[tuple[float, str]],
) -> dict[str, Any]:
    return {
        "gateway": {"version": "x", "policy": "default"},
        "totals": {
            "num_backends": 1,
            "num_routable": 1,
            "in_flight": in_flight,
            "req_per_s": req,
            "err_per_s": 0.5,
            "error_ratio": 0.5 / req,
            "req_per_s_series": series,
            "err_per_s_series": [0.5] * len(series),
        },
        "pools": [{"pool": "m", "in_flight": 3, "req_per_s": req, "err_per_s": 0.5}],
        "backends": [{"name": "a", "in_flight": 3, "latency_ms": latency}],
        "decisions": {
            "num_buffered": len(decisions),
            "recent": [
                {"t_wall_s": t, "request_id": rid, "backend": "a", "policy": "default"}
                for t, rid in decisions
            ],
            "by_policy": [{"policy": "default", "backend": "a", "count": len(decisions)}],
        },
    }


def test_two_workers_documents_make_the_gateways() -> None:
    own = _doc(
        2,
        4.0,
        [1.0, 2.0, 4.0],
        {"ttft_p50": [10.0, 20.0], "ttft_p95": [30.0, 40.0], "tpot_p50": [], "tpot_p95": []},
        [(5.0, "r5"), (3.0, "r3")],
    )
    other = _doc(
        1,
        2.0,
        [2.0, 2.0],
        {"ttft_p50": [None, 40.0], "ttft_p95": [None, 90.0], "tpot_p50": [], "tpot_p95": []},
        [(4.0, "r4")],
    )
    got = merge_states(own, [other])
    assert got["gateway"]["workers"] == 2
    totals = got["totals"]
    assert totals["in_flight"] == 3 and totals["req_per_s"] == 6.0
    assert totals["err_per_s"] == 1.0 and totals["error_ratio"] == 1.0 / 6.0
    assert totals["req_per_s_series"] == [1.0, 4.0, 6.0]  # aligned at the newest point
    assert got["pools"][0]["req_per_s"] == 6.0 and got["pools"][0]["in_flight"] == 3
    latency = got["backends"][0]["latency_ms"]
    assert latency["ttft_p50"] == [10.0, 30.0]  # mean of the known P50s
    assert latency["ttft_p95"] == [30.0, 90.0]  # the highest P95
    assert got["backends"][0]["in_flight"] == 3  # the shared table's, not summed
    decisions = got["decisions"]
    assert decisions["num_buffered"] == 3
    assert [r["request_id"] for r in decisions["recent"]] == ["r5", "r4"]  # newest, 2 shown
    assert decisions["by_policy"] == [{"policy": "default", "backend": "a", "count": 3}]


def test_without_siblings_the_document_is_the_workers_own() -> None:
    own = _doc(1, 1.0, [1.0], {"ttft_p50": [5.0], "ttft_p95": [6.0]}, [(1.0, "r1")])
    got = merge_states(own, [])
    assert got["gateway"]["workers"] == 1
    assert got["totals"]["req_per_s_series"] == [1.0]
    assert got["decisions"]["recent"] == own["decisions"]["recent"]
