"""LoRA placement shared by workers (gateway/lora_shared.py): two handles, one segment."""

from __future__ import annotations

import asyncio
import random

from segment_fixture import two_worker_segment  # noqa: F401 (the fixture ``segment``)
from test_peers import _Clock, _Settings

from kiloserve.gateway.lora_placement import Adapter, LoraPlacement
from kiloserve.gateway.lora_shared import LOG_SIZE, SharedLora
from kiloserve.policies.round_robin import RoundRobinPolicy
from kiloserve.routing.config import BackendConfig
from kiloserve.routing.router import Router
from kiloserve.routing.shared_load import SharedLoad
from kiloserve.routing.table import BackendTable


def _placement() -> LoraPlacement:
    cfgs = [BackendConfig(url=f"http://127.0.0.1:{9000 + i}", name=n, models=["base"])
            for i, n in enumerate(("a", "b"))]  # fmt: skip
    table = BackendTable(_Settings(cfgs))
    placement = LoraPlacement(table, Router(table, RoundRobinPolicy(), random.Random(0)), 4)
    placement.catalog["ad1"] = Adapter("ad1", "/a/ad1", "base")
    return placement


def test_a_load_or_unload_one_worker_makes_is_the_others_at_its_next_sync(
    segment: list[SharedLoad],
) -> None:
    clock = _Clock()
    p0, p1 = _placement(), _placement()
    s0, s1 = SharedLora(segment[0], 0, clock), SharedLora(segment[1], 1, clock)
    s1.sync(p1)
    version = segment[1].lora_version
    s1.sync(p1)  # nothing new: no read under the lock
    assert segment[1].lora_version == version and p1.holders("ad1") == []

    p0.set_held("b", "ad1", is_held=True, now_s=clock())
    s0.record("b", "ad1", held=True)
    s1.sync(p1)
    assert p1.holders("ad1") == ["b"]
    s0.record("b", "ad1", held=False)
    s0.record("a", "ad1", held=True)
    s1.sync(p1)
    assert p1.holders("ad1") == ["a"]
    s0.sync(p0)  # its own entries were seen when written: nothing to apply
    assert p0.holders("ad1") == ["b"]


def test_the_log_keeps_its_newest_entries(segment: list[SharedLoad]) -> None:
    s0 = SharedLora(segment[0], 0)
    for i in range(LOG_SIZE + 10):
        s0.record("a", f"ad{i}", held=True)
    with segment[1].lora_doc() as doc:
        events = doc["events"]
    assert len(events) == LOG_SIZE and events[-1] == [LOG_SIZE + 10, "a", f"ad{LOG_SIZE + 9}", True]


async def test_a_sibling_waits_for_the_claimed_load_and_then_finds_it_held(
    segment: list[SharedLoad],
) -> None:
    clock = _Clock()
    p0, p1 = _placement(), _placement()
    s0, s1 = SharedLora(segment[0], 0, clock), SharedLora(segment[1], 1, clock)

    def held_by(shared: SharedLora, placement: LoraPlacement) -> bool:
        shared.sync(placement)
        return bool(placement.holders("ad1"))

    assert await s0.claim("ad1", 30.0, lambda: held_by(s0, p0))
    waiter = asyncio.ensure_future(s1.claim("ad1", 30.0, lambda: held_by(s1, p1)))
    await asyncio.sleep(0.1)
    assert not waiter.done()  # worker 0 is loading it
    p0.set_held("a", "ad1", is_held=True, now_s=clock())
    s0.record("a", "ad1", held=True)
    s0.release("ad1")
    assert await asyncio.wait_for(waiter, 2.0) is False  # held now: no load of its own
    assert p1.holders("ad1") == ["a"] and s1.num_waits == 1
    with segment[1].lora_doc() as doc:
        assert doc["loading"] == {}


async def test_a_claim_older_than_its_expiry_is_taken_over(segment: list[SharedLoad]) -> None:
    """A worker that died while loading leaves its claim; a sibling takes it over once
    it is older than the expiry."""
    clock = _Clock()
    p1 = _placement()
    s0, s1 = SharedLora(segment[0], 0, clock), SharedLora(segment[1], 1, clock)
    assert await s0.claim("ad1", 30.0, lambda: False)
    waiter = asyncio.ensure_future(s1.claim("ad1", 30.0, lambda: bool(p1.holders("ad1"))))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    clock.now += 31.0
    assert await asyncio.wait_for(waiter, 2.0) is True
    s0.release("ad1")  # not its claim any more: left alone
    with segment[1].lora_doc() as doc:
        assert doc["loading"]["ad1"][0] == 1


def test_unloads_follow_the_gateways_last_requests_not_one_workers(
    segment: list[SharedLoad],
) -> None:
    """Backend b holds two adapters and room for two: loading a third unloads the least
    recently requested. Worker 1 saw ad1 long ago and ad2 later; worker 0 served ad1
    since: ad2 must go (worker 1's own view alone would unload ad1, busy on worker 0)."""
    clock = _Clock()
    p0, p1 = _placement(), _placement()
    for p in (p0, p1):
        p.max_adapters_per_backend = 2
        p.catalog["ad2"] = Adapter("ad2", "/a/ad2", "base")
        for name in ("ad1", "ad2"):
            p.set_held("b", name, is_held=True, now_s=0.0)
    s0, s1 = SharedLora(segment[0], 0, clock), SharedLora(segment[1], 1, clock)
    version = segment[0].lora_version
    for when, shared, p, name in ((1.0, s1, p1, "ad1"), (5.0, s1, p1, "ad2"),
                                  (10.0, s0, p0, "ad1"), (10.5, s0, p0, "ad1")):  # fmt: skip
        clock.now = when
        p.touch(name, ["b"], when)
        shared.touch(name, ["b"], when)
    assert segment[0].lora_version == version  # times written: no sibling sync re-reads
    assert p1.victims("b") == ["ad1"]  # worker 1's own share of the requests
    s1.take_uses(p1, clock())  # worker 0 wrote 10.0 (10.5 waits: USE_FLUSH_S)
    assert p1.victims("b") == ["ad2"]
    s1.record("b", "ad2", held=False)  # the unload drops the pair's time
    with segment[0].lora_doc() as doc:
        assert doc["used"] == {"b\tad1": 10.0}
