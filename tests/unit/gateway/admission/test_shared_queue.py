"""One admission order per pool across workers (``gateway/admission/shared_queue.py``).

Two controllers, each with its own table and router (two workers), sharing the load
(``routing.shared_load``: one budget) and the queue heads through one real
shared-memory segment. Before the sharing, a worker whose completion freed room gave
it to its own newer waiter while a sibling's older one kept waiting.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from kiloserve.errors import QueueFullError
from kiloserve.gateway.admission.controller import Admission, AdmissionController
from kiloserve.gateway.admission.queue import AdmissionConfig
from kiloserve.gateway.admission.shared_queue import SharedQueues
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies import create_policy
from kiloserve.policies.base import RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.shared_load import LoadLayout, SharedLoad
from kiloserve.routing.table import BackendTable

_ADMISSION = {"enabled": True, "capacity": {"max_in_flight_per_backend": 1}}


@pytest.fixture
def workers() -> Iterator[tuple[AdmissionController, AdmissionController]]:
    owner = SharedLoad.create(LoadLayout(workers=2, slots=8, ring=64, prefix_ring=16))
    loads = [SharedLoad.attach(owner.name, i) for i in (0, 1)]
    backend = {"url": "http://127.0.0.1:9", "name": "a", "models": ["m"]}
    cfg = parse_gateway_config({"backends": [backend]})
    ctls = []
    for load in loads:
        table = BackendTable(cfg)
        table.shared = load
        load.resync(table.state_or_none)
        router = Router(table, create_policy("least_request"), random.Random(0))
        ctl = AdmissionController(AdmissionConfig.model_validate(_ADMISSION), router)
        ctl.share = SharedQueues(load, ctl.cfg.max_queue_wait_s)
        ctl.share.clear()
        ctls.append(ctl)
    yield ctls[0], ctls[1]
    for load in loads:
        load.close()
    owner.close()


def _info(rid: str, priority: int = 0) -> RequestInfo:
    info = RequestInfo(rid, "m", input_tokens=20, predicted_output_tokens=10)
    return info.with_admission(priority, "")


async def _queued(ctl: AdmissionController, info: RequestInfo) -> asyncio.Future[Admission]:
    fut = asyncio.ensure_future(ctl.admit(info))
    await asyncio.sleep(0)
    assert not fut.done()
    return fut


async def test_freed_room_goes_to_the_older_waiter_on_the_other_worker(
    workers: tuple[AdmissionController, AdmissionController],
) -> None:
    a, b = workers
    first = await a.admit(_info("r1"))  # takes the one slot
    older = await _queued(b, _info("r2"))  # waits at worker B
    newer = await _queued(a, _info("r3"))  # worker A's queue was empty: it still waits
    a.done(first)  # room at worker A: its own r3 is newer than B's r2
    await asyncio.sleep(0)
    assert not newer.done()
    assert a.num_deferrals >= 1
    b.pump(time.monotonic())  # worker B's next tick
    second = await asyncio.wait_for(older, 1.0)
    assert not newer.done()
    b.done(second)
    a.pump(time.monotonic())
    assert (await asyncio.wait_for(newer, 1.0)).backend_id == "a"


async def test_a_higher_priority_waiter_on_this_worker_is_not_held_back(
    workers: tuple[AdmissionController, AdmissionController],
) -> None:
    a, b = workers
    first = await a.admit(_info("r1"))
    older_low = await _queued(b, _info("r2", priority=0))
    newer_high = await _queued(a, _info("r3", priority=5))
    a.done(first)
    assert (await asyncio.wait_for(newer_high, 1.0)).backend_id == "a"
    assert not older_low.done()
    older_low.cancel()


async def test_room_left_to_a_sibling_that_does_not_take_it_is_taken_after_a_while(
    workers: tuple[AdmissionController, AdmissionController],
) -> None:
    """The sibling's head may fit nowhere (or its worker stalls): after ``max_defer_s``
    the room is used, not left idle."""
    a, b = workers
    first = await a.admit(_info("r1"))
    stuck = await _queued(b, _info("r2"))  # worker B never pumps in this test
    mine = await _queued(a, _info("r3"))
    a.done(first)
    assert not mine.done()
    now = time.monotonic()
    a.pump(now + a.max_defer_s / 2)
    assert not mine.done()
    a.pump(now + a.max_defer_s + 0.01)
    assert (await asyncio.wait_for(mine, 1.0)).backend_id == "a"
    stuck.cancel()


async def test_a_head_past_the_queue_wait_limit_is_a_dead_workers_leftover(
    workers: tuple[AdmissionController, AdmissionController],
) -> None:
    a, b = workers
    assert b.share is not None
    b.share.publish("m", 1, 0, time.monotonic() - b.cfg.max_queue_wait_s - 5, (1, 0, 0))
    assert (await asyncio.wait_for(a.admit(_info("r1")), 1.0)).backend_id == "a"
    b.share.publish("m", 1, 0, time.monotonic(), (1, 0, 0))  # a live sibling's waiter
    assert a.share is not None and a.share.waiting("m", 0, time.monotonic())
    b.share.clear()  # what a replacement worker does first
    assert not a.share.waiting("m", 0, time.monotonic())


async def test_a_lane_bound_is_one_bound_for_the_gateway(
    workers: tuple[AdmissionController, AdmissionController],
) -> None:
    """``max_queue_len`` bounds a lane across the workers: with two waiting at worker B
    (the bound), an arrival at worker A is answered 429, not queued as a first (before:
    each worker had the whole bound). Another lane keeps its own room."""
    a, b = workers
    for ctl in workers:
        ctl.cfg = ctl.cfg.model_copy(update={"max_queue_len": 2})
    first = await a.admit(_info("r1"))  # takes the one slot
    waiting = [await _queued(b, _info(f"b{i}")) for i in range(2)]
    with pytest.raises(QueueFullError, match="short lane"):
        await asyncio.wait_for(a.admit(_info("r4")), 1.0)
    long = RequestInfo("r5", "m", input_tokens=5_000, predicted_output_tokens=10)
    other_lane = await _queued(a, long.with_admission(0, ""))
    for fut in [*waiting, other_lane]:
        fut.cancel()
    a.done(first)
