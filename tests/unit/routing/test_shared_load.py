"""The workers' shared in-flight view (routing/shared_load.py), two handles in one process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kiloserve.gateway.admission.ratelimit import Quota, SharedLimiter
from kiloserve.policies.base import BackendState, Outcome, RequestInfo
from kiloserve.routing.config import BackendConfig
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.shared_load import SCRAPE_FAILED, SCRAPE_OK, LoadLayout, SharedLoad
from kiloserve.routing.table import BackendTable


@dataclass
class _Settings:
    backends: list[BackendConfig]
    stale_after_s: float = 1.0
    max_scrape_failures: int = 3


def _table(*names: str) -> BackendTable:
    cfgs = [BackendConfig(url=f"http://127.0.0.1:{9000 + i}", name=n, models=["m"])
            for i, n in enumerate(names)]  # fmt: skip
    return BackendTable(_Settings(cfgs))


_OPEN: list[SharedLoad] = []


@pytest.fixture
def segment() -> Iterator[SharedLoad]:
    owner = SharedLoad.create(LoadLayout(workers=2, slots=8, ring=16))
    yield owner
    while _OPEN:
        _OPEN.pop().close()
    owner.close()


def _attach(segment: SharedLoad, index: int) -> SharedLoad:
    load = SharedLoad.attach(segment.name, index)
    _OPEN.append(load)
    return load


def _worker(segment: SharedLoad, index: int, table: BackendTable) -> SharedLoad:
    load = _attach(segment, index)
    table.shared = load
    load.resync(table.state_or_none)
    return load


def _info(tokens: int = 100, out: int = 10) -> RequestInfo:
    return RequestInfo("r", model="m", input_tokens=tokens, predicted_output_tokens=out)


def _load(s: BackendState) -> tuple[int, int, int]:
    return s.in_flight, s.outstanding_prefill_tokens, s.outstanding_decode_tokens


def test_each_worker_sees_the_others_in_flight(segment: SharedLoad) -> None:
    t0, t1 = _table("a", "b"), _table("a", "b")
    _worker(segment, 0, t0)
    _worker(segment, 1, t1)
    for _ in range(3):
        t0.on_dispatch("a", _info())
    t1.on_dispatch("a", _info(50, 5))
    t1.on_dispatch("b", _info())
    t0.sync()
    t1.sync()
    for t in (t0, t1):
        assert _load(t.state("a")) == (4, 350, 35)
        assert _load(t.state("b")) == (1, 100, 10)
    t0.on_first_token("a", _info(), 20.0)
    t0.on_complete("a", _info(), Outcome(ok=True), had_first_token=True)
    t1.on_complete("b", _info(), Outcome(ok=False), had_first_token=False)
    t0.sync()
    t1.sync()
    for t in (t0, t1):
        assert _load(t.state("a")) == (3, 250, 25)
        assert _load(t.state("b")) == (0, 0, 0)
    # what one worker learned, the other learned too
    assert t0.state("a").num_ttft_samples == t1.state("a").num_ttft_samples == 1
    assert t0.state("a").ewma_ttft_ms == t1.state("a").ewma_ttft_ms == 20.0


def _speeds(s: BackendState) -> tuple[float | None, float | None, float | None, int]:
    return s.ewma_prefill_work_tokens, s.ewma_ttft_ms, s.ewma_tpot_ms, s.num_ttft_samples


def test_every_worker_learns_from_every_workers_samples() -> None:
    """Samples taken by either worker (dispatch work, TTFT, TPOT) reach the other's
    EWMAs, in the order they were taken: two workers that alternate learn what one
    router seeing all of it learns."""
    owner = SharedLoad.create(LoadLayout(workers=2, slots=8, ring=4096))
    try:
        t0, t1, alone = _table("a", "b"), _table("a", "b"), _table("a", "b")
        _worker(owner, 0, t0)
        _worker(owner, 1, t1)
        for i in range(12):
            t = (t0, t1)[i % 2]
            info = _info(100 + 10 * i, 10)
            for table in (t, alone):
                table.on_dispatch("a", info)
                table.on_first_token("a", info, 30.0 + i)
                table.on_complete("a", info, Outcome(ok=True, tpot_ms=5.0 + i / 4),
                                  had_first_token=True)  # fmt: skip
            t0.sync()
            t1.sync()  # each pulls the other's samples before the next request
        expected = _speeds(alone.state("a"))
        assert expected[3] == 12 and None not in expected
        assert _speeds(t0.state("a")) == pytest.approx(expected)
        assert _speeds(t1.state("a")) == pytest.approx(expected)
        # counters are unchanged by samples, and b learned nothing
        assert _load(t0.state("a")) == _load(t1.state("a")) == (0, 0, 0)
        assert _speeds(t1.state("b")) == (None, None, None, 0)
        # a rebuild from the rows (a reader a ring behind) keeps what was learned
        t1.shared.resync(t1.state_or_none)  # type: ignore[union-attr]
        assert _speeds(t1.state("a")) == pytest.approx(expected)
    finally:
        while _OPEN:
            _OPEN.pop().close()
        owner.close()


def test_a_reader_more_than_a_ring_behind_rebuilds_from_the_rows(segment: SharedLoad) -> None:
    t0, t1 = _table("a"), _table("a")
    _worker(segment, 0, t0)
    w1 = _worker(segment, 1, t1)
    for _ in range(40):  # 40 x 3 ring entries through a 16-entry ring
        t0.on_dispatch("a", _info())
    t1.sync()
    assert _load(t1.state("a")) == (40, 4000, 400)
    assert w1.num_resyncs >= 2  # attach + overflow


def test_a_replacement_worker_retires_what_the_dead_one_counted(segment: SharedLoad) -> None:
    t0, t1 = _table("a"), _table("a")
    _worker(segment, 0, t0)
    w1 = _worker(segment, 1, t1)
    t1.on_dispatch("a", _info())
    t1.on_dispatch("a", _info())
    t0.on_dispatch("a", _info())
    t0.sync()
    assert t0.state("a").in_flight == 3
    _OPEN.remove(w1)
    w1.close()  # worker 1 dies with two requests in flight
    t1b = _table("a")
    w1b = _attach(segment, 1)
    assert w1b.retire_predecessor() == 1
    t1b.shared = w1b
    w1b.resync(t1b.state_or_none)
    t0.sync()
    assert _load(t0.state("a")) == (1, 100, 10)
    assert _load(t1b.state("a")) == (1, 100, 10)


def test_admission_grants_are_one_budget(segment: SharedLoad) -> None:
    t0, t1 = _table("a"), _table("a")
    _worker(segment, 0, t0)
    _worker(segment, 1, t1)
    t0.adjust_admission("a", in_flight=1, reserved=500, undispatched=500)
    t1.adjust_admission("a", in_flight=1, reserved=300, undispatched=300)
    t0.adjust_admission("a", undispatched=-500)
    t0.sync()
    t1.sync()
    for t in (t0, t1):
        s = t.state("a")
        assert (s.admitted_in_flight, s.reserved_tokens, s.undispatched_tokens) == (2, 800, 300)


def test_drains_reach_every_worker(segment: SharedLoad) -> None:
    t0, t1 = _table("a", "b"), _table("a", "b")
    _worker(segment, 0, t0)
    _worker(segment, 1, t1)
    t0.set_draining("b", True)
    t1.sync()
    assert t1.state("b").draining and not t1.state("a").draining
    t1.set_draining("b", False)
    t0.sync()
    assert not t0.state("b").draining


def test_a_backend_added_later_gets_what_peers_already_count(segment: SharedLoad) -> None:
    t0, t1 = _table("a", "late"), _table("a")
    _worker(segment, 0, t0)
    _worker(segment, 1, t1)
    t0.on_dispatch("late", _info())
    t1.sync()  # worker 1 does not know "late" yet
    t1.add_backend(BackendConfig(url="http://127.0.0.1:9100", name="late", models=["m"]))
    assert _load(t1.state("late")) == (1, 100, 10)


def test_attach_rejects_a_foreign_segment_and_a_bad_index(segment: SharedLoad) -> None:
    with pytest.raises(ValueError, match="outside"):
        SharedLoad.attach(segment.name, 2)


async def test_rate_limit_buckets_are_shared(segment: SharedLoad) -> None:
    a, b = SharedLimiter(_attach(segment, 0)), SharedLimiter(_attach(segment, 1))
    quota = Quota("k", max_requests_per_min=4, max_tokens_per_min=None)
    got = [await (a if i % 2 else b).acquire(quota, 1, 100.0) for i in range(6)]
    assert [w == 0.0 for w in got] == [True] * 4 + [False] * 2
    assert got[-1] == pytest.approx(15.0)  # one request a minute / 4


def test_a_published_scrape_reads_back_the_same(segment: SharedLoad) -> None:
    w0, w1 = _attach(segment, 0), _attach(segment, 1)
    m = EngineMetrics(engine="vllm", num_running=3, num_waiting=None, kv_usage=0.25,
                      prefix_queries_tokens=1e6)  # fmt: skip
    assert w1.get_scrape("a") is None
    w0.put_scrape("a", SCRAPE_OK, 123.5, m)
    assert w1.get_scrape("a") == (SCRAPE_OK, 123.5, m, "")
    w0.put_scrape("a", SCRAPE_FAILED, 124.0, reason="ClientConnectorError")
    assert w1.get_scrape("a") == (SCRAPE_FAILED, 124.0, None, "ClientConnectorError")


def test_a_follower_applies_fresh_scrapes_and_scrapes_itself_when_they_age(
    segment: SharedLoad,
) -> None:
    from kiloserve.gateway.scrape import _Follower

    w0, w1 = _attach(segment, 0), _attach(segment, 1)
    table = _table("a")
    follower = _Follower(w1, max_age_s=1.0)
    assert not follower.take(table, "a")  # nothing published yet: scrape yourself
    now = time.monotonic()
    w0.put_scrape("a", SCRAPE_OK, now, EngineMetrics(num_running=2, kv_usage=0.5))
    assert follower.take(table, "a")
    s = table.state("a")
    assert (s.num_running, s.kv_usage, s.scrape_stale) == (2, 0.5, False)
    w0.put_scrape("a", SCRAPE_OK, now - 5.0, EngineMetrics(num_running=9))
    assert not follower.take(table, "a")  # the scraper is stuck: scrape yourself
    assert table.state("a").num_running == 2
