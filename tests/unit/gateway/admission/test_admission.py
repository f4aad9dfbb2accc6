"""The pure admission queue: bounds, deadlines, lanes, ageing, fairness, windows, priorities."""

from __future__ import annotations

import pytest

from kiloserve.errors import QueueFullError
from kiloserve.gateway.admission.queue import AdmissionConfig, PoolQueue, Waiter, lane_of


def _w(
    rid: str,
    *,
    now: float = 0.0,
    input_tokens: int = 10,
    need: int | None = None,
    priority: int = 0,
    tenant: str = "a",
    q: PoolQueue | None = None,
    wait_s: float = 10.0,
) -> Waiter:
    eligible = q.window_end(now) if q is not None else now
    return Waiter(
        rid, need if need is not None else input_tokens + 10, input_tokens, priority, tenant,
        now, now + wait_s, eligible,
    )  # fmt: skip


def _drain(q: PoolQueue, now: float, fits: object = None) -> list[str]:
    out = []
    while (w := q.pick(now, (lambda _w: True) if fits is None else fits)) is not None:  # type: ignore[arg-type]
        out.append(w.request_id)
    return out


def test_lanes_follow_the_thresholds() -> None:
    cfg = AdmissionConfig(short_max_tokens=128, long_min_tokens=1024)
    assert lane_of(127, cfg) == "short"
    assert lane_of(128, cfg) == "medium"
    assert lane_of(1024, cfg) == "medium"
    assert lane_of(1025, cfg) == "long"


def test_each_lane_is_bounded_separately() -> None:
    q = PoolQueue(AdmissionConfig(max_queue_len=2))
    q.push(_w("l1", input_tokens=2000))
    q.push(_w("l2", input_tokens=2000))
    with pytest.raises(QueueFullError):
        q.push(_w("l3", input_tokens=2000))
    q.push(_w("s1", input_tokens=5))  # the short lane still has room
    assert (q.depth("long"), q.depth("short"), len(q)) == (2, 1, 3)


def test_expire_returns_only_requests_past_their_deadline() -> None:
    q = PoolQueue(AdmissionConfig())
    q.push(_w("old", now=0.0, wait_s=1.0))
    q.push(_w("new", now=0.5, wait_s=1.0))
    assert [w.request_id for w in q.expire(1.2)] == ["old"]
    assert [w.request_id for w in q.waiters()] == ["new"]
    assert q.expire(1.2) == []


def test_short_requests_pass_a_long_one_that_does_not_fit() -> None:
    q = PoolQueue(AdmissionConfig())
    q.push(_w("long", input_tokens=3000, need=5000))
    q.push(_w("short", now=0.1, input_tokens=20, need=100))
    got = q.pick(0.2, lambda w: w.need_tokens <= 1000)
    assert got is not None and got.request_id == "short"
    assert [w.request_id for w in q.waiters()] == ["long"]


def test_short_lane_goes_first_when_everything_fits() -> None:
    q = PoolQueue(AdmissionConfig())
    q.push(_w("long", input_tokens=3000))
    q.push(_w("mid", input_tokens=500))
    q.push(_w("short", input_tokens=20))
    assert _drain(q, 0.1) == ["short", "mid", "long"]


def test_a_starving_request_is_passed_only_by_shorter_prompts() -> None:
    q = PoolQueue(AdmissionConfig(starvation_s=1.0))
    q.push(_w("long", now=0.0, input_tokens=3000, need=5000))
    q.push(_w("short", now=0.9, input_tokens=20, need=100))
    small_only = lambda w: w.need_tokens <= 1000  # noqa: E731
    assert q.pick(0.95, small_only) is not None  # before starvation: short passes
    q.push(_w("longer", now=1.0, input_tokens=4000, need=600))
    assert q.pick(1.5, small_only) is None  # long has starved: a longer one may not pass
    q.push(_w("mid", now=1.0, input_tokens=500, need=600))
    got = q.pick(1.5, small_only)
    assert got is not None and got.request_id == "mid"  # shorter prompts still may
    got = q.pick(1.5, lambda w: True)
    assert got is not None and got.request_id == "long"


def test_strict_priority_with_ageing() -> None:
    q = PoolQueue(AdmissionConfig(ageing_s=1.0, starvation_s=100.0))
    q.push(_w("low-old", now=0.0, priority=0))
    q.push(_w("high", now=1.5, priority=1))
    # at t=1.6 low-old has aged one class (1.6 s // 1 s = 1): ties, then the lane and
    # tenant; at t=0.5 (hypothetically) high would win outright
    assert q.ordered(1.6)[0].request_id == "low-old"
    q2 = PoolQueue(AdmissionConfig(ageing_s=10.0, starvation_s=100.0))
    q2.push(_w("low", now=0.0, priority=0))
    q2.push(_w("high", now=0.5, priority=2))
    assert _drain(q2, 1.0) == ["high", "low"]


def test_weighted_priorities_share_releases_by_weight() -> None:
    cfg = AdmissionConfig(priority_mode="weighted", priority_weights={0: 1.0, 1: 3.0})
    q = PoolQueue(cfg)
    for i in range(40):
        q.push(_w(f"lo{i}", now=i * 1e-3, priority=0))
        q.push(_w(f"hi{i}", now=i * 1e-3, priority=1))
    first = [q.pick(1.0, lambda w: True) for _ in range(20)]
    num_hi = sum(1 for w in first if w is not None and w.request_id.startswith("hi"))
    assert 14 <= num_hi <= 16  # 3:1 -> 15 of 20
    assert num_hi < 20  # weighted, not strict: the low class is not starved


def test_fair_share_between_two_tenants() -> None:
    q = PoolQueue(AdmissionConfig())
    for i in range(50):  # tenant a bursts first
        q.push(_w(f"a{i}", now=i * 1e-4, tenant="a"))
    for i in range(5):
        q.push(_w(f"b{i}", now=0.01 + i * 1e-4, tenant="b"))
    first_ten = _drain_n(q, 10)
    assert sum(1 for r in first_ten if r.startswith("b")) == 5  # b interleaved, not last


def _drain_n(q: PoolQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        w = q.pick(1.0, lambda _w: True)
        assert w is not None
        out.append(w.request_id)
    return out


def test_tenant_weights_bias_the_share() -> None:
    q = PoolQueue(AdmissionConfig(tenant_weights={"big": 3.0}))
    for i in range(30):
        q.push(_w(f"big{i}", now=0.0, tenant="big"))
        q.push(_w(f"small{i}", now=0.0, tenant="small"))
    got = _drain_n(q, 20)
    assert 14 <= sum(1 for r in got if r.startswith("big")) <= 16


def test_window_mode_holds_arrivals_then_releases_smallest_first() -> None:
    q = PoolQueue(AdmissionConfig(window_s=0.1))
    q.push(_w("big", now=0.01, need=900, q=q))
    q.push(_w("small", now=0.05, need=50, q=q))
    q.push(_w("mid", now=0.07, need=300, q=q))
    assert q.pick(0.09, lambda w: True) is None  # the window is still open
    budget = [600]

    def fits(w: Waiter) -> bool:
        if w.need_tokens > budget[0]:
            return False
        budget[0] -= w.need_tokens
        return True

    assert _drain(q, 0.1, fits) == ["small", "mid"]  # 50 + 300 fit in 600; 900 waits
    assert [w.request_id for w in q.waiters()] == ["big"]


def test_remove_keeps_counts_consistent() -> None:
    q = PoolQueue(AdmissionConfig(max_queue_len=1))
    w = _w("x")
    q.push(w)
    assert q.remove(w) is True
    assert q.remove(w) is False
    q.push(_w("y"))  # the lane slot was returned
    assert len(q) == 1


def test_ageing_with_one_priority_class_keeps_the_lane_order() -> None:
    q = PoolQueue(AdmissionConfig(ageing_s=2.0, starvation_s=100.0))
    q.push(_w("long-old", now=0.0, input_tokens=8000))
    q.push(_w("mid-new", now=9.9, input_tokens=500))
    # 10 s of ageing would lift long-old five classes above mid-new; with no higher
    # class waiting it lifts it nowhere, so the medium prompt still goes first
    assert [w.request_id for w in q.ordered(10.0)] == ["mid-new", "long-old"]
