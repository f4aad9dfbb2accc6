"""The live controller's S2.2 / S2.3 rules on a real router and table (no I/O)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from kiloserve.gateway.admission import capacity
from kiloserve.gateway.admission.capacity import CapacityConfig
from kiloserve.gateway.admission.controller import Admission, AdmissionController
from kiloserve.gateway.admission.queue import AdmissionConfig, PoolQueue, Waiter
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies import create_policy
from kiloserve.policies.base import RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable


def _controller(kv_capacity_tokens: int = 100_000, **admission: Any) -> AdmissionController:
    backend = {"url": "http://127.0.0.1:9", "name": "a", "models": ["m"]}
    backend["kv_capacity_tokens"] = kv_capacity_tokens
    cfg = parse_gateway_config({"backends": [backend]})
    router = Router(BackendTable(cfg), create_policy("least_request"), random.Random(0))
    return AdmissionController(AdmissionConfig.model_validate(admission), router)


def _info(rid: str, input_tokens: int, output_tokens: int) -> RequestInfo:
    return RequestInfo(rid, "m", input_tokens=input_tokens, predicted_output_tokens=output_tokens)


async def test_need_is_the_seed_estimate_unless_the_kv_size_is_known() -> None:
    unknown = await _controller(enabled=True).admit(_info("r", 100, 40))
    assert unknown.need_tokens == 100 + 300  # (100 * 200 KB + 40 * 1500 KB) / 200 KB
    known_cfg = {"kv_bytes_per_token": {"m": 131072}}
    known = await _controller(enabled=True, capacity=known_cfg).admit(_info("r", 100, 40))
    assert known.need_tokens == 140


async def test_the_engine_prefill_queue_is_bounded_by_default() -> None:
    ctl = _controller(enabled=True, max_queue_wait_s=5.0)
    assert CapacityConfig().max_queued_prefill_tokens is not None
    first = await ctl.admit(_info("doc1", 6000, 10))
    ctl.dispatched(first)
    ctl.router.dispatch("a", _info("doc1", 6000, 10))  # prompt sent, no first token yet
    second = asyncio.ensure_future(ctl.admit(_info("doc2", 6000, 10)))
    await asyncio.sleep(0)
    assert not second.done()  # waits at the gateway, not in the engine's queue
    short: Admission = await ctl.admit(_info("hi", 20, 10))  # a short prompt still goes
    assert short.backend_id == "a"
    ctl.router.first_token("a", _info("doc1", 6000, 10), 50.0)  # doc1 prefilled
    ctl.pump(time.monotonic())
    assert (await asyncio.wait_for(second, 1.0)).backend_id == "a"


async def test_an_engine_that_runs_everything_lifts_the_prefill_bound() -> None:
    # a non-streamed request shows no first token until it ends, so the gateway's own
    # prefill count keeps its prompt; the engine's scrape says it is running
    ctl = _controller(enabled=True, max_queue_wait_s=5.0)
    first = await ctl.admit(_info("doc1", 6000, 10))
    ctl.dispatched(first)
    ctl.router.dispatch("a", _info("doc1", 6000, 10))
    s = ctl.table.state("a")
    s.scrape_stale, s.num_waiting, s.num_running = False, 0, 0  # predates doc1
    second = asyncio.ensure_future(ctl.admit(_info("doc2", 6000, 10)))
    await asyncio.sleep(0)
    assert not second.done()
    s.num_running = 1  # the next scrape: doc1 runs, nothing waits
    ctl.pump(time.monotonic())
    assert (await asyncio.wait_for(second, 1.0)).backend_id == "a"


def test_prefill_room_rule() -> None:
    cfg = CapacityConfig(max_queued_prefill_tokens=8192)
    assert capacity.has_prefill_room(cfg, 0, 20_000, is_short=False)  # an empty queue takes one
    assert capacity.has_prefill_room(cfg, 4000, 4000, is_short=False)
    assert not capacity.has_prefill_room(cfg, 4000, 5000, is_short=False)
    assert capacity.has_prefill_room(cfg, 9000, 50, is_short=True)
    assert capacity.has_prefill_room(cfg, 9000, 9000, is_short=False, is_caught_up=True)
    assert capacity.has_prefill_room(
        CapacityConfig(max_queued_prefill_tokens=None), 9000, 9000, False
    )


def _waiter(q: PoolQueue, rid: str, need: int, now: float) -> Waiter:
    w = Waiter(rid, need, 500, 0, "", now, now + 30.0, q.window_end(now))
    q.push(w)
    return w


def test_window_leftovers_wait_for_the_next_window() -> None:
    q = PoolQueue(AdmissionConfig(window_s=0.1))
    _waiter(q, "big", 900, 0.01)
    _waiter(q, "small", 50, 0.02)
    assert q.pick(0.1, lambda w: w.need_tokens < 100) is not None  # "small" goes
    assert q.pick(0.1, lambda w: w.need_tokens < 100) is None  # "big" does not fit
    q.hold_leftovers(0.1)
    # room frees up at 0.15 (a completion, a tick): "big" still waits for 0.2
    assert q.pick(0.15, lambda w: True) is None
    late = q.pick(0.2, lambda w: True)
    assert late is not None and late.request_id == "big"


def test_without_windows_leftovers_are_not_held() -> None:
    q = PoolQueue(AdmissionConfig(window_s=0.0))
    _waiter(q, "big", 900, 0.01)
    q.hold_leftovers(0.01)
    assert q.pick(0.015, lambda w: True) is not None


async def test_a_completion_does_not_release_a_window_leftover() -> None:
    cap = {"max_in_flight_per_backend": 1}
    ctl = _controller(enabled=True, window_s=1.0, max_queue_wait_s=30.0, capacity=cap)
    q = ctl._queue("m")
    first = asyncio.ensure_future(ctl.admit(_info("a", 500, 10)))
    await asyncio.sleep(0)
    boundary_s = q.waiters()[0].eligible_s
    ctl.pump(boundary_s)  # the window closes: "a" takes the only slot
    adm = await asyncio.wait_for(first, 1.0)
    second = asyncio.ensure_future(ctl.admit(_info("b", 500, 10)))
    await asyncio.sleep(0)
    ctl.pump(q.waiters()[0].eligible_s)  # b's window closes while "a" holds the slot
    ctl.done(adm)  # a completion frees the slot mid-window
    ctl.pump(boundary_s + 0.5)  # a tick, still inside the next window
    await asyncio.sleep(0)
    assert not second.done()
    ctl.pump(boundary_s + 1.0)  # the next window closes
    assert (await asyncio.wait_for(second, 1.0)).backend_id == "a"
