"""length_least_conn: short requests to the shortest queue, long ones to the most free KV."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.errors import ConfigError
from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    kw.setdefault("kv_usage", 0.0)
    return BackendState(backend_id=bid, **kw)


# "busy": many short requests, little KV used; "full": one huge request holds its KV
BUSY = {"num_running": 6, "num_waiting": 2, "kv_usage": 0.2}
FULL = {"num_running": 1, "num_waiting": 0, "kv_usage": 0.9}


@pytest.mark.parametrize(
    ("input_tokens", "output_tokens", "params", "expected"),
    [
        (100, 50, {}, ("full", "busy", "idle_none")),  # short: fewest requests first
        (900, 124, {}, ("full", "busy", "idle_none")),  # 1024 is still short (> 1024: long)
        (900, 125, {}, ("busy", "full", "idle_none")),  # 1025: long, most free KV first
        (8000, 10, {}, ("busy", "full", "idle_none")),
        (100, 50, {"short_max_tokens": 100}, ("busy", "full", "idle_none")),
    ],
)
def test_short_to_shortest_queue_long_to_most_free_kv(
    input_tokens: int, output_tokens: int, params: dict[str, Any], expected: tuple[str, ...]
) -> None:
    s = ClusterSnapshot(
        0.0,
        (
            backend("busy", **BUSY),
            backend("full", **FULL),
            backend("idle_none", num_running=None, kv_usage=None),  # unknown: last in both
        ),
    )
    request = RequestInfo("r", "m", input_tokens, output_tokens)
    decision = create_policy("length_least_conn", params).choose(request, s, random.Random(0))
    assert decision.ranked == expected


@pytest.mark.parametrize(
    ("kw_a", "kw_b", "long_pick", "short_pick"),
    [
        # free tokens when every candidate knows its KV size: 0.5 * 200k > 0.8 * 50k
        (
            {"kv_usage": 0.5, "kv_capacity_tokens": 200_000},
            {"kv_usage": 0.2, "kv_capacity_tokens": 50_000},
            "a",
            "a",
        ),
        # prompts sent and not started count as taken: 0.5 * 200k - 120k < 0.8 * 50k
        (
            {"kv_usage": 0.5, "kv_capacity_tokens": 200_000, "outstanding_prefill_tokens": 120_000},
            {"kv_usage": 0.2, "kv_capacity_tokens": 50_000},
            "b",
            "b",
        ),
        # one size unknown: free fractions, 0.8 > 0.5 (short: equal load, tie by free KV)
        ({"kv_usage": 0.5, "kv_capacity_tokens": 200_000}, {"kv_usage": 0.2}, "b", "b"),
        # capacity weight: b demoted to 0.2 -> free 0.8 * 0.2, load 1 / 0.2
        (
            {"kv_usage": 0.5, "num_running": 2},
            {"kv_usage": 0.2, "num_running": 1, "effective_weight": 0.2},
            "a",
            "a",
        ),
        # in-flight counter above the scraped queue (scrape lag): max of the two counts
        ({"in_flight": 3}, {"num_running": 2}, "b", "b"),
        ({"in_flight": 3, "kv_usage": 0.1}, {"num_running": 2, "kv_usage": 0.5}, "a", "b"),
        # equal load: short requests break the tie by free KV; equal KV: long by load
        ({"kv_usage": 0.4}, {"kv_usage": 0.3}, "b", "b"),
        ({"num_running": 2}, {"num_running": 1}, "b", "b"),
        # stale scrape: unknown load and full KV, never first
        ({"scrape_stale": True}, {"num_running": 5, "kv_usage": 0.9}, "b", "b"),
    ],
)
def test_signal_rules(
    kw_a: dict[str, Any], kw_b: dict[str, Any], long_pick: str, short_pick: str
) -> None:
    s = ClusterSnapshot(0.0, (backend("a", **kw_a), backend("b", **kw_b)))
    policy = create_policy("length_least_conn")
    long_req, short_req = RequestInfo("l", "m", 3000, 200), RequestInfo("s", "m", 50, 20)
    assert policy.choose(long_req, s, random.Random(0)).ranked[0] == long_pick
    assert policy.choose(short_req, s, random.Random(0)).ranked[0] == short_pick


def test_exact_sequence_as_loads_move() -> None:
    """Dispatches move the gateway's in-flight counters: shorts fill the idle queue."""
    a, b = backend("a", kv_usage=0.1), backend("b", kv_usage=0.6)
    s = ClusterSnapshot(0.0, (a, b))
    policy = create_policy("length_least_conn")
    picks = []
    for size in "ssllls":
        request = RequestInfo(size, "m", 4000 if size == "l" else 40, 10)
        pick = policy.choose(request, s, random.Random(0)).ranked[0]
        (a if pick == "a" else b).in_flight += 1
        picks.append(pick)
    # s: tie, more free KV (a); s: b (0 < 1); l l l: a (free KV, load ignored); s: b
    assert "".join(picks) == "abaaab"


def test_bad_params_and_no_candidate() -> None:
    with pytest.raises(ConfigError, match="short_max_tokens"):
        create_policy("length_least_conn", {"short_max_tokens": 0})
    s = ClusterSnapshot(0.0, (backend("a", draining=True),))
    decision = create_policy("length_least_conn").choose(
        RequestInfo("r", "m", 1, 1), s, random.Random(0)
    )
    assert decision.ranked == ()
