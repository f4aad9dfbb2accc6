"""Gateways that act as one (gateway/peers.py): the view logic, messages passed by hand."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import orjson

from kiloserve.gateway.peers import PeerConfig, PeerLoad
from kiloserve.policies.base import Outcome, RequestInfo
from kiloserve.routing.config import BackendConfig
from kiloserve.routing.table import BackendTable


@dataclass
class _Settings:
    backends: list[BackendConfig]
    stale_after_s: float = 1.0
    max_scrape_failures: int = 3


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gateway(clock: _Clock, instance: str) -> tuple[BackendTable, PeerLoad]:
    cfgs = [BackendConfig(url=f"http://127.0.0.1:{9000 + i}", name=n, models=["m"])
            for i, n in enumerate(("a", "b"))]  # fmt: skip
    table = BackendTable(_Settings(cfgs))
    peers = PeerLoad(PeerConfig(enabled=True), "redis://unused", instance=instance, clock=clock)
    table.shared = peers
    return table, peers


def _info() -> RequestInfo:
    return RequestInfo("r", model="m", input_tokens=100, predicted_output_tokens=10)


def _send(src: PeerLoad, *dst: PeerLoad, full: bool = False) -> None:
    raw = src._message(full=full)
    if raw is not None:
        for d in dst:
            d._inbox.append(orjson.loads(raw))


def test_two_gateways_see_each_others_in_flight() -> None:
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    for _ in range(3):
        t1.on_dispatch("a", _info())
    t2.on_dispatch("a", _info())
    t2.on_dispatch("b", _info())
    _send(p1, p2)
    _send(p2, p1)
    t1.sync()
    t2.sync()
    for t in (t1, t2):
        assert (t.state("a").in_flight, t.state("b").in_flight) == (4, 1)
        assert t.state("a").outstanding_prefill_tokens == 400
    t1.on_complete("a", _info(), Outcome(ok=True), had_first_token=False)
    _send(p1, p2)
    t2.sync()
    assert t2.state("a").in_flight == 3 and p2.num_peers == 1


def test_messages_are_totals_so_a_lost_one_is_corrected_by_the_next() -> None:
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    t1.on_dispatch("a", _info())
    p1._message(full=False)  # lost on the way
    t1.on_dispatch("a", _info())
    _send(p1, p2)
    t2.sync()
    assert t2.state("a").in_flight == 2


def test_a_silent_peer_is_forgotten_and_a_snapshot_zeroes_what_it_omits() -> None:
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    t1.on_dispatch("a", _info())
    t1.on_dispatch("b", _info())
    _send(p1, p2)
    t2.sync()
    assert (t2.state("a").in_flight, t2.state("b").in_flight) == (1, 1)
    t1.on_complete("b", _info(), Outcome(ok=True), had_first_token=False)
    p1._dirty.clear()  # the change message is lost; the next snapshot omits "b"
    _send(p1, p2, full=True)
    t2.sync()
    assert (t2.state("a").in_flight, t2.state("b").in_flight) == (1, 0)
    clock.now += 3.5  # g1 dies: nothing more from it
    t2.sync()
    assert t2.state("a").in_flight == 0 and p2.num_peers == 0


def test_a_lost_channel_falls_back_to_the_own_view() -> None:
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    t1.on_dispatch("a", _info())
    t2.on_dispatch("a", _info())
    _send(p1, p2)
    t2.sync()
    assert t2.state("a").in_flight == 2
    p2.connected = True
    p2._lost(ConnectionError("redis down"))
    t2.sync()
    assert t2.state("a").in_flight == 1 and not p2.connected and p2.num_failures == 1


def test_sibling_workers_and_itself_are_ignored_on_the_channel() -> None:
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "same"), _gateway(clock, "same")
    p2.peer_id = "same:other-pid"
    t1.on_dispatch("a", _info())
    _send(p1, p1, p2)
    t1.sync()
    t2.sync()
    assert (t1.state("a").in_flight, t2.state("a").in_flight) == (1, 0)


def test_a_backend_added_later_gets_the_peers_counts() -> None:
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    t1.add_backend(BackendConfig(url="http://127.0.0.1:9100", name="late", models=["m"]))
    t1.on_dispatch("late", _info())
    _send(p1, p2)
    t2.sync()  # g2 does not know "late" yet
    t2.add_backend(BackendConfig(url="http://127.0.0.1:9100", name="late", models=["m"]))
    assert t2.state("late").in_flight == 1


def _speeds(t: BackendTable, name: str) -> tuple[float | None, float | None, float | None, int]:
    s = t.state(name)
    return s.ewma_prefill_work_tokens, s.ewma_ttft_ms, s.ewma_tpot_ms, s.num_ttft_samples


def test_each_gateway_learns_from_the_others_samples() -> None:
    """Learned speeds travel with the totals: g2 learns g1's TTFT and TPOT samples; a
    sibling worker's message (same instance) and malformed samples teach nothing."""
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    t1.on_dispatch("a", _info())
    t1.on_first_token("a", _info(), 40.0)
    t1.on_complete("a", _info(), Outcome(ok=True, tpot_ms=8.0), had_first_token=True)
    _send(p1, p2)
    t2.sync()
    assert _speeds(t2, "a") == _speeds(t1, "a") == (100.0, 40.0, 8.0, 1)
    assert _speeds(t2, "b") == (None, None, None, 0)
    assert p1._message(full=False) is None  # sent once: nothing new to say

    t3, p3 = _gateway(clock, "g1")  # a sibling worker of g1: shares through memory
    t3.on_first_token("a", _info(), 400.0)
    _send(p3, p1)
    t1.sync()
    assert _speeds(t1, "a") == (100.0, 40.0, 8.0, 1)
    junk = [["a", 1, "x"], ["a", 7, 1.0], ["a", True, 1.0], "junk", ["a", 1], ["a", 1, 1e400]]
    p2._inbox.append({"id": "g9:1", "inst": "g9", "b": {}, "s": junk})
    t2.sync()
    assert _speeds(t2, "a") == (100.0, 40.0, 8.0, 1)


def test_samples_wait_for_the_next_message_within_a_bound() -> None:
    from kiloserve.gateway.peers import MAX_SAMPLES_PER_MESSAGE

    clock = _Clock()
    t1, p1 = _gateway(clock, "g1")
    for i in range(MAX_SAMPLES_PER_MESSAGE + 5):
        t1.on_first_token("a", _info(), float(i))
    raw = p1._message(full=False)
    assert raw is not None
    samples = orjson.loads(raw)["s"]
    assert len(samples) == MAX_SAMPLES_PER_MESSAGE  # the oldest dropped
    assert samples[-1] == ["a", 1, float(MAX_SAMPLES_PER_MESSAGE + 4)]


class _Redis:
    """What the send loop calls: ``publish`` (messages recorded with their time)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict[str, object]]] = []

    async def publish(self, channel: str, msg: bytes) -> None:
        self.sent.append((time.monotonic(), orjson.loads(msg)))


async def test_a_change_after_a_quiet_spell_is_sent_at_once_and_bursts_are_batched() -> None:
    """The first change after the flush interval goes out at once (it used to wait for
    the loop's next tick, up to ``flush_interval_s``); later changes of the same
    interval wait for it to end. A long flush interval makes the two cases plain."""
    table = _gateway(_Clock(), "g1")[0]
    peers = PeerLoad(
        PeerConfig(enabled=True, flush_interval_s=2.0, snapshot_interval_s=60.0),
        "redis://unused",
        instance="g1",
    )
    table.shared = peers
    redis = _Redis()
    peers._redis = redis
    task = asyncio.ensure_future(peers._send_loop())
    try:
        await asyncio.sleep(0.05)
        assert len(redis.sent) == 1 and redis.sent[0][1]["full"]  # the first snapshot
        await asyncio.sleep(2.2)  # a quiet spell longer than the flush interval
        t0 = time.monotonic()
        table.on_dispatch("a", _info())
        await asyncio.sleep(0.5)
        assert len(redis.sent) == 2, redis.sent
        sent_at, msg = redis.sent[1]
        assert sent_at - t0 < 0.5 and msg["b"] == {"a": [1, 100, 10, 0, 0, 0]}
        table.on_dispatch("b", _info())  # within the interval: batched
        table.on_dispatch("a", _info())
        await asyncio.sleep(0.5)
        assert len(redis.sent) == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_gateway_with_several_workers_is_one_peer() -> None:
    """Each worker of a ``--workers 2`` gateway sends as its own process (``INSTANCE:PID``,
    same instance): ``kiloserve_gateway_peers`` counts that gateway once (before: twice)."""
    clock = _Clock()
    (t1, p1), (t2, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    t1.on_dispatch("a", _info())
    _send(p1, p2)
    p1.peer_id = "g1:another-worker"  # the same gateway's other worker
    _send(p1, p2, full=True)
    t2.sync()
    assert p2.num_peers == 1


def test_each_gateway_learns_the_others_responses_ids() -> None:
    """A Responses id one gateway learnt reaches the other's ``ResponseOwners``, so a
    ``previous_response_id`` follow-up through it finds the backend that holds the
    conversation (before, only the gateway that relayed the answer knew it)."""
    from kiloserve.gateway.extra_apis import ResponseOwners
    from kiloserve.routing.shared_responses import response_key

    clock = _Clock()
    (_, p1), (_, p2) = _gateway(clock, "g1"), _gateway(clock, "g2")
    owners1, owners2 = ResponseOwners(), ResponseOwners()
    for owners, peers in ((owners1, p1), (owners2, p2)):
        owners.peers = peers.publish_response
        peers.on_response = owners.take
    owners1.remember("resp_1", "a")
    raw = p1._message(full=False)  # an id alone is worth a message
    assert raw is not None and orjson.loads(raw)["r"] == [[response_key("resp_1"), "a"]]
    p2._take(orjson.loads(raw), lambda _b: None)
    assert owners2.owner("resp_1") == "a" and owners2.owner("resp_2") is None
    bad = {"id": "g3:1", "inst": "g3", "r": [[1.5, "a"], ["k", "a"], [1 << 64, "a"], [2, ""], 7]}
    p2._take(bad, lambda _b: None)  # malformed entries are skipped
    assert len(owners2) == 1
