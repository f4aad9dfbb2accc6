"""Disaggregated prefill/decode: one client request as two legs, vLLM's proxy protocol.

Which requests split, and the pair, are ``routing/disagg.py``'s (shared with the
simulator); this module speaks the wire protocol of vLLM's disaggregated-serving proxy
(``examples/online_serving/disaggregated_serving``, NixlConnector):

1. prefill leg: the client's request to a ``prefill`` backend (the active policy
   restricted to that role) with ``max_tokens: 1`` (and ``max_completion_tokens: 1``
   when present), ``stream: false``, no ``stream_options`` / ``min_tokens`` /
   ``min_completion_tokens``, the request's ``X-Request-Id``, and
   ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
   "remote_port": null}``;
2. the ``kv_transfer_params`` of its JSON answer;
3. decode leg: the client's request as sent (its own ``stream`` and ``max_tokens``) plus
   those params, with the same ``X-Request-Id``, to the ``decode`` backend
   (``rank_decode``: least KV usage, then in-flight, ranked when the prefill answer
   is in, so decode legs sent meanwhile count), through the proxy
   (``gateway/proxy.py``: relay, retries, mid-stream failover, accounting).

A prefill answer whose ``kv_transfer_params`` is null or absent (connectors that move
KV through shared storage: vLLM's ExampleConnector, LMCache) sends the decode leg
without params, as vLLM's proxy does.

Failover: a prefill backend that fails (connect error, 5xx / 429, or
``disagg.transfer_timeout_s``) -> the next prefill backend of
the policy's ranking (at most ``retries + 1`` in all); none left -> the whole request,
without params, to the decode backends first, then the rest of the model's pool
(``fallback``). A decode leg that fails before its first byte -> the next decode backend
with the same params (the proxy's retries); none left -> the whole request to the
model's other backends (``fallback``). A prefill backend's 4xx (other than 429) is the
client's answer, as the proxy passes 4xx through. After the first byte the proxy's
mid-stream failover applies; a continuation carries no KV params (``gateway/migrate.py``),
so it goes to the other decode backends, then ``both``, then ``prefill`` ones.

Deadline: the legs and fallbacks share one ``request_timeout_s``, counted from the
split's start: the decode leg and any whole-request fallback get what the prefill leg
left, and a request past it gets the gateway's 504 (``GatewayTimeoutError``) with no
further leg sent.

Accounting: each leg is an attempt on its backend (``Router.dispatch`` ...
``complete``): the prefill backend holds the request in flight during its leg (a
one-token request), the decode backend counts the transferred prompt tokens as cached.
``kiloserve_gateway_disagg_requests_total{mode}`` counts ``split`` (served by a decode
leg), ``colocated`` (the rule kept it whole: a short prompt with a ``both`` backend)
and ``fallback`` (split by the rule, served whole after a failed half);
``kiloserve_gateway_disagg_prefill_seconds{backend}`` is the prefill leg's time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from kiloserve.errors import BackendError, BadGatewayError, GatewayTimeoutError
from kiloserve.gateway.api_hooks import HOOKS_KEY
from kiloserve.gateway.headers import (
    REQUEST_ID_HEADER,
    client_headers,
    forwarded_drop,
    relayed_headers,
)
from kiloserve.gateway.proxy import ProxyContext, forward
from kiloserve.policies.base import Decision, RequestInfo
from kiloserve.routing.disagg import rank_decode, role_pools, should_split, unsplit_order

__all__ = ["PREFILL_KV_PARAMS", "SplitPlan", "forward_split", "plan_split", "prefill_body"]

logger = logging.getLogger(__name__)

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_SPLIT_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_CLIENT_GONE = 499


@dataclass(slots=True)
class SplitPlan:
    """A split request's legs: the policy's prefill ranking, the decode ranking (taken
    at the arrival, for a fallback after failed prefill legs; taken again when the
    prefill answer is in, for the decode leg), and the admission layer's decision for
    a whole-request fallback (None: decide then)."""

    prefill: Decision
    decode: tuple[str, ...]
    fallback: Decision | None = None


def _splittable(path: str, body: dict[str, Any]) -> bool:
    """One completion of one prompt (vLLM's KV transfer is per request), not already
    carrying the client's own ``kv_transfer_params``."""
    if path not in _SPLIT_PATHS or "kv_transfer_params" in body:
        return False
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int))


def plan_split(
    ctx: ProxyContext,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    info: RequestInfo,
    decision: Decision | None,
) -> SplitPlan | None:
    """The legs of ``info`` when the split rule splits it, else None (counted as
    ``colocated`` when the model has prefill/decode-role backends)."""
    table = ctx.table
    if not table.has_roles:
        return None
    pools = role_pools(table.pool(info.model))
    if not pools.prefill and not pools.decode:
        return None  # this model runs whole everywhere: nothing to count
    if (
        request.get(HOOKS_KEY) is not None  # an agent-era API (gateway/api_hooks.py)
        or not _splittable(path, body)
        or not should_split(pools, info.input_tokens, ctx.cfg.disagg)
    ):
        ctx.metrics.disagg("colocated")
        return None
    prefill = ctx.router.decide(_prefill_info(info), time.monotonic(), role="prefill")
    if not prefill.ranked:  # every prefill backend refused by the circuit breakers
        ctx.metrics.disagg("colocated")
        return None
    return SplitPlan(prefill, rank_decode(pools.decode), decision)


def _prefill_info(info: RequestInfo) -> RequestInfo:
    return info.replaced(predicted_output_tokens=1, max_tokens=1)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request (module docstring, step 1)."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def _kv_params(answer: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) else None


async def _post(
    ctx: ProxyContext, request: web.Request, path: str, payload: bytes, backend_id: str,
    request_id: str, budget_s: float,
) -> tuple[int, bytes, web.Response | None] | tuple[int, str, None]:  # fmt: skip
    """POST the prefill leg and read its whole answer: (status, body, the answer to relay
    for a 4xx) or (status, why it failed, None) when no answer came."""
    resp = None
    try:
        async with asyncio.timeout(budget_s):
            ours = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
            theirs = client_headers(request, forwarded_drop(has_keys=bool(ctx.cfg.auth.keys)))
            resp = await ctx.upstream.post(
                ctx.table.url_of(backend_id), path, payload, ours, theirs
            )
            answer = await resp.read()
    except TimeoutError:
        if resp is not None:
            resp.close()
        return 504, "timeout", None
    except (BackendError, OSError) as exc:
        if resp is not None:
            resp.close()
        return 502, f"connect_error:{type(exc).__name__}", None
    except BaseException:  # cancelled (the client went away): the backend must see it
        if resp is not None:
            resp.close()
        raise
    resp.release()
    relay = None
    if 400 <= resp.status < 500 and resp.status != 429:
        headers = relayed_headers(request_id, backend_id, resp, "application/json")
        relay = web.Response(status=resp.status, body=answer, headers=headers)
    return resp.status, answer, relay


async def _prefill_on(
    ctx: ProxyContext,
    request: web.Request,
    path: str,
    payload: bytes,
    info: RequestInfo,
    backend_id: str,
    deadline: float,
) -> dict[str, Any] | web.Response | str:
    """One prefill attempt: the decode leg's params, a 4xx answer to relay, or why it
    failed. Accounted exactly once on ``backend_id`` as a one-token request."""
    router, loop = ctx.router, asyncio.get_running_loop()
    started = loop.time()
    budget_s = min(ctx.cfg.disagg.transfer_timeout_s, deadline - started)
    router.dispatch(backend_id, info)
    status, ok = _CLIENT_GONE, False
    got: dict[str, Any] | web.Response | str
    try:
        status, answer, relay = await _post(
            ctx, request, path, payload, backend_id, info.request_id, budget_s
        )
        if isinstance(answer, str):
            got = answer
        elif relay is not None:  # the client's own error: passed through, backend fine
            ok, got = True, relay
        elif status != 200:
            got = f"http_{status}"
        else:
            # null / absent params are an answer too: connectors that move KV through
            # shared storage (vLLM's ExampleConnector, LMCache) return none, and the
            # decode leg then goes without (as vLLM's proxy: it forwards only a non-empty
            # ``kv_transfer_params``)
            ok, got = True, _kv_params(answer) or {}
        return got
    finally:
        now = loop.time()
        is_served = ok and status == 200
        router.complete(
            backend_id, info, ok=ok, status=status if ok or status != 200 else 502,
            started_s=started, first_token_s=None, last_token_s=now,
            output_tokens=1 if is_served else 0,
        )  # fmt: skip
        if is_served:
            ctx.metrics.observe_prefill_leg(backend_id, now - started)


async def _prefill(
    ctx: ProxyContext,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    info: RequestInfo,
    plan: SplitPlan,
    deadline: float,
) -> dict[str, Any] | web.Response | None:
    """The prefill leg over the plan's prefill backends in rank order; None when every
    one failed."""
    payload = orjson.dumps(prefill_body(body))
    leg_info = _prefill_info(info)
    loop = asyncio.get_running_loop()
    for i, backend_id in enumerate(plan.prefill.ranked[: ctx.cfg.retries + 1]):
        if i > 0 and loop.time() >= deadline:
            break
        attempt = ctx.router.attempt_info(leg_info, plan.prefill.cached_blocks, backend_id)
        got = await _prefill_on(ctx, request, path, payload, attempt, backend_id, deadline)
        if not isinstance(got, str):
            return got
        ctx.metrics.retry(backend_id, "prefill_" + got.split(":")[0])
        logger.warning(
            "request_id=%s backend=%s prefill leg failed (%s)", info.request_id, backend_id, got
        )
    return None


def _failed_before_first_byte(resp: web.StreamResponse) -> bool:
    """True for the proxy's relay of the last backend's 5xx / 429 (nothing sent yet)."""
    return not resp.prepared and (resp.status >= 500 or resp.status == 429)


async def _whole(
    ctx: ProxyContext,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    raw: bytes,
    info: RequestInfo,
    plan: SplitPlan,
    first: tuple[str, ...],
    deadline: float,
    skip: frozenset[str] = frozenset(),
) -> web.StreamResponse:
    """The ``fallback``: the client's request, whole, to ``first`` then the rest of the
    unsplit ranking, leaving out ``skip`` (when that leaves any), by ``deadline``."""
    _check_deadline(ctx, info, deadline)
    ctx.metrics.disagg("fallback")
    decision = plan.fallback or ctx.router.decide(info, time.monotonic())
    ranked = [b for b in (*first, *decision.ranked) if b not in skip]
    ordered = tuple(dict.fromkeys(ranked)) or decision.ranked
    if not ordered:
        ordered = plan.decode
    ordered_decision = decision.with_ranked(ordered)
    return await forward(ctx, request, path, body, raw, info, ordered_decision, deadline=deadline)


def _check_deadline(ctx: ProxyContext, info: RequestInfo, deadline: float) -> None:
    """504 (``GatewayTimeoutError``) once the split's deadline has passed (its legs and
    fallbacks share one ``request_timeout_s``), counted as the request's answer."""
    if asyncio.get_running_loop().time() < deadline:
        return
    ctx.metrics.request_done(info.model, "", GatewayTimeoutError.status)
    timeout_s = ctx.cfg.request_timeout_s
    raise GatewayTimeoutError(f"the request ran past its {timeout_s:g} s (request_timeout_s)")


def _continuations(ctx: ProxyContext, info: RequestInfo, plan: SplitPlan) -> tuple[str, ...]:
    """Where a decode leg's stream cut after its first byte goes on: a continuation
    carries no KV params (it recomputes), so any backend of the model runs it: the
    other decode backends first, then ``both``, then ``prefill`` ones."""
    table = ctx.table
    rest = unsplit_order([b.backend_id for b in table.pool(info.model)], table.role_of)
    return tuple(dict.fromkeys((*plan.decode, *rest)))


async def forward_split(
    ctx: ProxyContext,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    raw: bytes,
    info: RequestInfo,
    plan: SplitPlan,
) -> web.StreamResponse:
    """Serve one split request (module docstring): prefill leg, then decode leg."""
    deadline = asyncio.get_running_loop().time() + ctx.cfg.request_timeout_s
    got = await _prefill(ctx, request, path, body, info, plan, deadline)
    if isinstance(got, web.Response):
        return got
    if got is None:
        logger.warning("request_id=%s every prefill leg failed: whole request", info.request_id)
        return await _whole(ctx, request, path, body, raw, info, plan, plan.decode, deadline)
    _check_deadline(ctx, info, deadline)  # the decode leg gets what the prefill left
    decode_body = {**body, "kv_transfer_params": got} if got else body
    # ranked now, not at the arrival: the decode legs sent while this prefill ran are
    # in flight on their backends (ranked at the arrival, overlapping prefills would
    # all pick the same decode backend)
    plan.decode = rank_decode(role_pools(ctx.table.pool(info.model)).decode) or plan.decode
    # the transferred prompt tokens (all but the last, as vLLM's NixlConnector) count as
    # cached on the decode backend: its outstanding prefill work is the rest
    num_blocks = max(0, info.input_tokens - 1) // ctx.router.block_size
    decode = Decision(
        plan.decode, "disagg_decode", cached_blocks=dict.fromkeys(plan.decode, num_blocks)
    )
    try:
        resp = await forward(
            ctx, request, path, decode_body, orjson.dumps(decode_body), info, decode,
            continue_on=_continuations(ctx, info, plan), deadline=deadline,
        )  # fmt: skip
    except BadGatewayError:  # no decode backend answered (the 504 subclass too)
        resp = None
    if resp is not None and not _failed_before_first_byte(resp):
        ctx.metrics.disagg("split")
        return resp
    logger.warning("request_id=%s every decode leg failed: whole request", info.request_id)
    tried = frozenset(plan.decode[: ctx.cfg.retries + 1])
    return await _whole(ctx, request, path, body, raw, info, plan, (), deadline, tried)
