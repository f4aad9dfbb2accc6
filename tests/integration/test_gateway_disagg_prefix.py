"""The gateway's prefill leg follows the prefix (issue #19: "prefill by queue and prefix"),
over LIVE twins: three ``prefill``-role twins and one ``decode``-role twin behind a real
gateway with the DEFAULT policy, all on 127.0.0.1.

A split request's prefill leg is chosen by ``Router.decide(..., role="prefill")``: the
active policy among the prefill twins (``gateway/disagg.py``). With the default policy
(``scored``: ttft, queue, kv, prefix; sticky to the deepest prefix holder until it is
saturated) a request whose long prompt shares a prefix with an earlier one must find
the prefill twin that computed that prefix, and that twin's own prefix cache must hit;
an unrelated long prompt must avoid a prefill twin that is busy with a leg.

Which prefill twin served a leg is read from both sides, request by request (every
request is sent alone and waited for): the gateway's
``kiloserve_gateway_disagg_prefill_seconds_count{backend}`` and each twin's
``vllm:prompt_tokens_total`` / ``vllm:prefix_cache_hits_total``. The control runs the
same requests under ``round_robin``, which ignores prefixes: the legs spread and miss
the cache, so the measurement tells the two apart.

Determinism: the scraped state never goes stale during a test (``stale_after_s`` far
above the test's length: on a loaded box a late scrape would read as a saturated
backend), the gateway has scraped every twin before the first request, and the "busy"
twin is busy with a leg it never answers (the twin's ``hang`` fault; its ``/metrics``
still answers, and the gateway's active health probes are off, so nothing vetoes it and
no probe adds to a twin's counters), so no timing decides anything.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from test_gateway_disagg_twins import HELD, MODEL, metrics, modes, pd_gateway, pd_twins, post
from test_gateway_fakes import admin_backends, post_faults, running_gateway

from kiloserve.engine.server import TwinServer
from kiloserve.gateway.config import GatewayConfig
from kiloserve.tokens import count_tokens, filler_text

BLOCK = 16  # the gateway's and the twins' KV block
HEAD_TOKENS = 1200  # over the policy's 512 for prefix scoring, and disagg's 1024 split rule
HEAD = filler_text(HEAD_TOKENS, seed=7)
UNRELATED = filler_text(HEAD_TOKENS + 24, seed=8)
HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
LEGS = "kiloserve_gateway_disagg_prefill_seconds_count"
PREFILLS = ("p0", "p1", "p2")


def shared(i: int) -> str:
    """A prompt with ``HEAD`` as its prefix and a short tail of its own."""
    return HEAD + " " + filler_text(24, seed=100 + i)


def gateway(named: dict[str, TwinServer], policy: str) -> GatewayConfig:
    return pd_gateway(
        named,
        policy={"name": policy},
        scrape_interval_s=0.2,
        scrape_timeout_s=5.0,
        stale_after_s=600.0,
        disagg={"transfer_timeout_s": 60.0},  # a hung leg stays on its twin
        health={"enabled": False},  # no probe of its own on a twin (nor a veto of a hung one)
    )


async def until(what: str, check: Any, timeout_s: float = 20.0) -> None:
    """Poll the async predicate ``check`` until it holds."""
    for _ in range(int(timeout_s / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


async def scraped(gw: str, num_backends: int) -> None:
    """Every backend routable with its engine state scraped."""

    async def ok() -> bool:
        rows = await admin_backends(gw)
        good = [r for r in rows.values() if r["routable"] and r["kv_usage"] is not None]
        return len(good) == num_backends

    await until("every backend scraped", ok)


def _body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 3}


@dataclass(frozen=True)
class Leg:
    backend: str  # the prefill twin whose leg the gateway counted
    prompt_tokens: dict[str, float]  # prompt tokens each prefill twin computed for it
    hits: dict[str, float]  # prefix-cache hits (tokens) on each prefill twin


async def counts(gw: str, twins: dict[str, TwinServer]) -> tuple[dict[str, float], ...]:
    gw_m = await metrics(gw)
    legs = {n: gw_m.get(f"{LEGS}{{backend={n}}}", 0.0) for n in twins}
    twin_m = {n: await metrics(t.url) for n, t in twins.items()}
    prompts = {n: m.get(PROMPT_TOKENS, 0.0) for n, m in twin_m.items()}
    return legs, prompts, {n: m.get(HITS, 0.0) for n, m in twin_m.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {n: after[n] - before[n] for n in after}


async def serve(gw: str, twins: dict[str, TwinServer], prompt: str, rid: str) -> Leg:
    """One split request, alone: which prefill twin ran its leg, and what each prefill
    twin computed and hit for it (read once that twin has released the leg's KV)."""
    before = await counts(gw, twins)
    status, headers, raw = await post(gw, _body(prompt), rid)
    assert status == 200, raw
    assert headers["x-kiloserve-backend"] == "d0"  # the decode leg answered
    legs = delta((await counts(gw, twins))[0], before[0])
    served = [n for n, v in legs.items() if v]
    assert len(served) == 1 and legs[served[0]] == 1, legs
    twin = twins[served[0]]
    await until(f"{served[0]} released the KV", lambda: _released(twin))
    _, prompts, hits = await counts(gw, twins)
    return Leg(served[0], delta(prompts, before[1]), delta(hits, before[2]))


async def _released(twin: TwinServer) -> bool:
    return (await metrics(twin.url)).get(HELD) == 0


async def hold(gw: str, hung: list[asyncio.Task[Any]], prompt: str, rid: str) -> None:
    """Send ``prompt`` in the background and wait until its prefill leg is placed: every
    request of ``hung`` that has not ended holds a leg in flight on a prefill twin (one
    that went to an answering twin ends; the caller's assertions say so)."""
    hung.append(asyncio.create_task(post(gw, _body(prompt), rid)))

    async def placed() -> bool:
        rows = await admin_backends(gw)
        num_legs = sum(rows[n]["in_flight"] for n in PREFILLS)
        return num_legs == sum(not t.done() for t in hung)

    await until(f"{rid} placed", placed)


async def test_prefill_legs_follow_the_prefix_and_avoid_a_busy_prefill_twin() -> None:
    async with pd_twins("prefill", "prefill", "prefill", "decode") as (*ps, d0):
        prefills = dict(zip(PREFILLS, ps, strict=True))
        async with running_gateway(gateway({**prefills, "d0": d0}, "default")) as gw:
            await scraped(gw, 4)
            first = await serve(gw, prefills, shared(0), "a")
            holder = first.backend
            others = [n for n in PREFILLS if n != holder]
            # a cold cache: the whole prompt computed there, nothing elsewhere
            assert first.prompt_tokens[holder] == count_tokens(shared(0))
            assert first.hits == dict.fromkeys(PREFILLS, 0.0)
            followers = [await serve(gw, prefills, shared(i), f"b{i}") for i in (1, 2, 3)]

            # queue: the holder busy with a leg it never answers (the gateway holds it
            # in flight); an unrelated long prompt goes to an idle prefill twin, and a
            # prompt with the cached prefix still goes to the holder (one leg queued
            # there costs less than recomputing the prefix)
            await post_faults(prefills[holder].url, {"hang": True})
            hung: list[asyncio.Task[Any]] = []
            await hold(gw, hung, shared(10), "h1")
            unrelated = await serve(gw, prefills, UNRELATED, "c")
            await hold(gw, hung, shared(11), "h2")
            done = [t.done() for t in hung]
            rows = await admin_backends(gw)
            for task in hung:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            gw_m = await metrics(gw)

    whole_blocks = HEAD_TOKENS // BLOCK * BLOCK
    for i, leg in enumerate(followers, 1):
        assert leg.backend == holder, (i, leg)
        # the holder's cache served the shared prefix (every whole block of it)
        assert whole_blocks <= leg.hits[holder] < count_tokens(shared(i)), (i, leg)
        assert leg.prompt_tokens[holder] == count_tokens(shared(i)), (i, leg)
        assert all(leg.prompt_tokens[n] == 0 and leg.hits[n] == 0 for n in others), (i, leg)
    assert unrelated.backend in others, unrelated
    assert unrelated.hits == dict.fromkeys(PREFILLS, 0.0), unrelated
    assert done == [False, False]
    assert rows[holder]["in_flight"] == 2, rows
    assert all(rows[n]["in_flight"] == 0 for n in others), rows
    assert modes(gw_m) == {"split": 5}


async def test_control_round_robin_spreads_the_prefix_and_misses_the_cache() -> None:
    """The same requests under a policy that ignores prefixes: the measurement above
    sees the legs leave the holder and the cache miss (so it can fail)."""
    async with pd_twins("prefill", "prefill", "prefill", "decode") as (*ps, d0):
        prefills = dict(zip(PREFILLS, ps, strict=True))
        async with running_gateway(gateway({**prefills, "d0": d0}, "round_robin")) as gw:
            await scraped(gw, 4)
            first = await serve(gw, prefills, shared(0), "a")
            followers = [await serve(gw, prefills, shared(i), f"b{i}") for i in (1, 2, 3)]
    away = [leg for leg in followers if leg.backend != first.backend]
    assert away, followers
    # a leg on a twin that never saw the prefix computes it again: no hits
    assert all(leg.hits[leg.backend] == 0 for leg in away), away
    assert len({leg.backend for leg in (first, *followers)}) == len(PREFILLS)
