"""Proxying one request: dispatch, retries before the first byte, stream relay, accounting.

Retry rule: a connect error, a 5xx, a 429 or a first-byte timeout moves the request to
the next backend of the decision's ranked list (at most ``retries`` times, within the
request's deadline). Once a byte has been written to the client there is no retry.
A backend's 4xx (other than 429) is passed through unchanged; when no backend answered at
all, ``forward`` raises ``BadGatewayError`` / ``GatewayTimeoutError`` (502 / 504, answered
by ``gateway/errors.py``).
When the client goes away the upstream response is closed, so the engine aborts the
request and frees its KV.

Mid-stream failover (docs/gateway.md, "Mid-stream failover"): a stream whose backend
breaks (``crash``) or goes silent for the stall timeout (``stall``) after bytes reached
the client is continued on the next backend of the same ranked list, at most
``migration.max_attempts`` times; ``gateway/migrate.py`` rewrites the request and
splices the continuation's events. The bytes written are kept (one list append per
write) and parsed only on failure. The failed attempt is accounted as failed (502, or
504 for a stall) before the continuation is dispatched; each continuation is an attempt
of its own. When no continuation succeeds the client gets the SSE error event as before.

Every attempt is accounted exactly once (``_Attempt.finish`` -> ``Router.complete``)
and its upstream response is always released or closed, however it ends: an answer,
an upstream failure, a time-out, the client gone before or while the response is
prepared or during a write, or the handler cancelled.

Headers pass through both ways as through a transparent proxy (``gateway/headers.py``,
docs/gateway.md, "Header pass-through").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from kiloserve.errors import BackendError, BadGatewayError, GatewayTimeoutError, NotFoundError
from kiloserve.gateway.api_hooks import HOOKS_KEY, ApiHooks
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.dashboard_state import DashboardRecorder
from kiloserve.gateway.headers import (
    BACKEND_HEADER,
    CACHED_TOKENS_HEADER,
    REQUEST_ID_HEADER,
    Pairs,
    client_headers,
    forwarded_drop,
    relayed_headers,
)
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.gateway.migrate import (
    MIGRATE_HEADER,
    Splicer,
    continuation_body,
    end_events,
    migratable,
    migration_requested,
    parse_delivered,
    stall_timeout_s,
)
from kiloserve.gateway.profile import Profiler
from kiloserve.gateway.proxy_body import stream_payload, usage_tokens
from kiloserve.gateway.sse import SseRelay
from kiloserve.gateway.stall import StallWatchdog
from kiloserve.gateway.tracing import TRACE_KEY, AttemptTrace, RequestTrace
from kiloserve.gateway.upstream import UpstreamPool, UpstreamResponse
from kiloserve.policies.base import Decision, RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

__all__ = ["BACKEND_HEADER", "REQUEST_ID_HEADER", "ProxyContext", "forward"]

logger = logging.getLogger(__name__)

_CLIENT_GONE = 499


@dataclass(slots=True)
class ProxyContext:
    """Per-app objects the proxy needs (no module globals)."""

    cfg: GatewayConfig
    upstream: UpstreamPool
    table: BackendTable
    metrics: GatewayMetrics
    router: Router  # decide once, dispatch, first token, complete (routing/router.py)
    profiler: Profiler
    num_in_flight: int = 0
    dashboard: DashboardRecorder | None = None  # live dashboard ring buffers (dashboard.py)
    is_traced: bool = False  # OpenTelemetry spans per request (gateway/tracing.py)


@dataclass(slots=True)
class _Call:
    """One client request in flight through the proxy."""

    request: web.Request
    path: str
    payload: bytes
    info: RequestInfo
    user: str | None
    is_stream: bool
    strip_usage: bool
    deadline: float
    loop: asyncio.AbstractEventLoop
    body: dict[str, Any] | None = None  # the client's request, kept when it may migrate
    ranked: tuple[str, ...] = ()  # the decision's backends, for continuations
    cached_blocks: Mapping[str, int] | None = None  # the decision's prefix matches
    hooks: ApiHooks | None = None  # an agent-era API's (gateway/api_hooks.py)
    trace: RequestTrace | None = None  # tracing on (gateway/tracing.py)


@dataclass(slots=True)
class _Cut:
    """A stream broken after bytes reached the client, that may be continued."""

    reason: str  # crash, error or stall
    sent: list[bytes]  # the bytes written to the client so far


@dataclass(slots=True)
class _Failure:
    """Why an attempt failed before any byte reached the client."""

    reason: str
    status: int = 502
    body: bytes | None = None
    headers: Pairs | None = None  # the engine's answer's headers, to relay with ``body``


def _our_headers(call: _Call, backend_id: str) -> dict[str, str]:
    return {REQUEST_ID_HEADER: call.info.request_id, BACKEND_HEADER: backend_id}


def _add_cached_tokens(headers: list[tuple[str, str]], att: _Attempt) -> None:
    """``x-kiloserve-prefix-cached-tokens``: the prompt tokens the policy found cached on
    the backend that answers (the engines' own KV events where exact, else the
    gateway's approximate index; ``Router.cached_tokens``). Absent for policies that do
    not look (issue 14)."""
    if att.call.cached_blocks is not None:
        headers.append((CACHED_TOKENS_HEADER, str(att.info.cached_tokens)))


def _upstream_error(
    status: int, message: str, headers: dict[str, str] | None = None
) -> BadGatewayError:
    """The gateway's own 502 (connect error) or 504 (time-out) for a failed request."""
    cls = GatewayTimeoutError if status == GatewayTimeoutError.status else BadGatewayError
    return cls(message, headers=headers)


def _failure_response(call: _Call, backend_id: str, failure: _Failure) -> web.Response:
    """The last backend's own answer (5xx / 429), relayed unchanged; without one (it did
    not answer), raises the gateway's ``BadGatewayError`` / ``GatewayTimeoutError``."""
    if failure.body is None or failure.headers is None:
        message = f"no backend could serve the request ({failure.reason})"
        raise _upstream_error(failure.status, message, _our_headers(call, backend_id))
    return web.Response(status=failure.status, body=failure.body, headers=failure.headers)


def _retryable_status(status: int) -> bool:
    return status >= 500 or status == 429


class _Attempt:
    """One try of one request on one backend, with its accounting."""

    __slots__ = (
        "backend_id", "call", "ctx", "first_token_at", "info", "is_finished",
        "last_chunk_at", "loop", "output_tokens", "span", "started",
    )  # fmt: skip

    def __init__(self, ctx: ProxyContext, call: _Call, backend_id: str) -> None:
        self.ctx = ctx
        self.call = call
        self.backend_id = backend_id
        # the profile, with the prompt tokens expected cached on this backend (accounting)
        self.info = ctx.router.attempt_info(call.info, call.cached_blocks, backend_id)
        self.loop = call.loop
        self.started = self.loop.time()
        self.first_token_at: float | None = None
        self.last_chunk_at = self.started
        self.output_tokens = 0
        self.is_finished = False
        self.span: AttemptTrace | None = None  # tracing on: set by ``_try_backend``

    def dispatch(self) -> None:
        self.ctx.router.dispatch(self.backend_id, self.info)

    def mark_first_token(self, now: float) -> None:
        self.first_token_at = now
        ttft_s = now - self.started
        self.ctx.router.first_token(self.backend_id, self.info, ttft_s * 1000.0)
        self.ctx.metrics.observe_ttft(self.backend_id, ttft_s)
        if self.span is not None:
            self.span.first_token()

    def finish(self, ok: bool, status: int) -> None:
        """Account the attempt (``Router.complete``, metrics); only the first call counts."""
        if self.is_finished:
            return
        self.is_finished = True
        ctx, info, bid = self.ctx, self.info, self.backend_id
        now = self.loop.time()
        ctx.router.complete(
            bid, info, ok=ok, status=status, started_s=self.started,
            first_token_s=self.first_token_at, last_token_s=self.last_chunk_at,
            output_tokens=self.output_tokens,
        )  # fmt: skip
        ctx.metrics.request_done(info.model, bid, status)
        if self.span is not None:
            self.span.end(status, self.output_tokens)
        if ok:
            ctx.metrics.observe_e2e(bid, now - self.started)
            if status == 200 and self.output_tokens:
                ctx.profiler.outputs.observe(self.call.user, info.model, self.output_tokens)
        logger.debug(
            "request_id=%s backend=%s status=%d e2e_ms=%.1f output_tokens=%d",
            info.request_id, bid, status, (now - self.started) * 1000.0, self.output_tokens,
        )  # fmt: skip


async def _try_backend(
    ctx: ProxyContext, call: _Call, att: _Attempt, payload: bytes | None = None
) -> tuple[UpstreamResponse, bytes] | _Failure:
    """Open the upstream request and wait for its first byte, bounded by the timeouts."""
    loop_time = att.loop.time()
    cfg = ctx.cfg
    first_byte_s = cfg.first_byte_timeout_s if call.is_stream else cfg.non_stream_timeout_s
    budget_s = min(first_byte_s, call.deadline - loop_time)
    resp: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(budget_s):
            base_url = ctx.table.url_of(att.backend_id)
            ours = {"Content-Type": "application/json", REQUEST_ID_HEADER: call.info.request_id}
            theirs = client_headers(call.request, forwarded_drop(has_keys=bool(cfg.auth.keys)))
            body = call.payload if payload is None else payload
            if call.trace is not None:  # this attempt's span, its traceparent upstream
                att.span = call.trace.attempt(att.backend_id, base_url, call.path)
                theirs = att.span.carry(ours, theirs)
            resp = await ctx.upstream.post(base_url, call.path, body, ours, theirs)
            if att.span is not None:
                att.span.connected()
            if _retryable_status(resp.status) or resp.status != 200 or not call.is_stream:
                body = await resp.read()
                return resp, body
            return resp, await resp.readany()
    except TimeoutError:
        if resp is not None:
            resp.close()
        return _Failure("first_byte_timeout", status=504)
    except (BackendError, OSError) as exc:
        if resp is not None:
            resp.close()
        return _Failure(f"connect_error:{type(exc).__name__}")
    except BaseException:  # cancelled (client gone): the backend must see it too
        if resp is not None:
            resp.close()
        raise


def _whole_response(
    call: _Call, att: _Attempt, resp: UpstreamResponse, body: bytes
) -> web.Response:
    if resp.status == 200:
        att.output_tokens = usage_tokens(body)
        if call.hooks is not None and call.hooks.on_data is not None:
            call.hooks.on_data(att.backend_id, body)
        att.last_chunk_at = att.loop.time()  # the end: non-streamed TTFT is estimated from it
    headers = relayed_headers(call.info.request_id, att.backend_id, resp, "application/json")
    _add_cached_tokens(headers, att)
    return web.Response(status=resp.status, body=body, headers=headers)


def _watchdog(
    ctx: ProxyContext, call: _Call, att: _Attempt, resp: UpstreamResponse, relay: SseRelay
) -> StallWatchdog | None:
    mig = ctx.cfg.migration
    if not mig.stall_detection:
        return None
    try:
        tpot_ms = ctx.table.state(att.backend_id).ewma_tpot_ms
    except NotFoundError:  # removed from the table meanwhile (registry)
        tpot_ms = None
    min_events = 1 if call.path.endswith("/chat/completions") else 0
    timeout_s = stall_timeout_s(mig, tpot_ms)
    return StallWatchdog(att, resp, relay, timeout_s, ctx.cfg.first_byte_timeout_s, min_events)


async def _pump(
    ctx: ProxyContext,
    att: _Attempt,
    resp: UpstreamResponse,
    out: web.StreamResponse,
    relay: SseRelay,
    chunk: bytes,
    sent: list[bytes] | None,
    splicer: Splicer | None,
    dog: StallWatchdog | None,
) -> None:
    observe_itl = ctx.metrics.observe_itl
    loop_time = att.loop.time
    hooks = att.call.hooks
    marker = hooks.first_token_marker if hooks is not None else None
    while chunk:
        data = relay.feed(chunk)
        if data:
            now = loop_time()
            if hooks is not None and hooks.on_data is not None:
                hooks.on_data(att.backend_id, data)
            if att.first_token_at is None:
                if marker is None or marker in data:  # the first content event
                    att.mark_first_token(now)
            else:
                observe_itl(att.backend_id, now - att.last_chunk_at)
            att.last_chunk_at = now
            if splicer is not None:
                data = splicer.feed(data)
            if sent is not None:
                sent.append(data)
            if data:
                await out.write(data)
        chunk = await resp.readany()
    if dog is not None and dog.stalled:
        return  # cut by the stall timeout: a partial event stays unsent
    rest = relay.flush()
    if rest:
        await out.write(rest)


async def _stream(
    ctx: ProxyContext,
    call: _Call,
    att: _Attempt,
    resp: UpstreamResponse,
    out: web.StreamResponse,
    first: bytes,
    sent: list[bytes] | None,
    splicer: Splicer | None = None,
) -> tuple[int, str | None]:
    """Relay one upstream stream into ``out``; returns (status, why it broke: crash,
    error or stall, None when it did not break mid-stream or cannot be continued).

    A client already gone when the response is prepared (``prepare`` raises
    ``ClientConnectionResetError``) or during a write ends it with 499; aiohttp then
    finds the response unwritable and drops the connection quietly."""
    marker = call.hooks.first_token_marker if call.hooks is not None else None
    relay = SseRelay(strip_usage=call.strip_usage and splicer is None, count=marker)
    dog = _watchdog(ctx, call, att, resp, relay)
    status, reason = 200, None
    try:
        async with asyncio.timeout(call.deadline - att.loop.time()):
            if not out.prepared:
                await out.prepare(call.request)
            await _pump(ctx, att, resp, out, relay, first, sent, splicer, dog)
    except ConnectionError:  # the client went away (aiohttp's ClientConnectionResetError)
        status = _CLIENT_GONE
    except TimeoutError:
        status = 504
    except BackendError:
        status, reason = 502, "crash"
    except OSError:
        status, reason = 502, "error"
    finally:
        if dog is not None:
            dog.cancel()
    if dog is not None and dog.stalled and status == 200:
        status, reason = 504, "stall"
    num_other = 0 if marker is not None else 1  # events counted that carry no token
    att.output_tokens = relay.completion_tokens or max(0, relay.num_events - num_other)
    if status != 200:
        logger.warning(
            "request_id=%s backend=%s stream ended early (status %d)",
            call.info.request_id, att.backend_id, status,
        )  # fmt: skip
    return status, reason


async def _relay(
    ctx: ProxyContext, call: _Call, att: _Attempt, resp: UpstreamResponse, first: bytes
) -> tuple[web.StreamResponse, int, _Cut | None]:
    """Stream the upstream SSE body to the client as it arrives; returns (response,
    status, the cut to continue elsewhere or None)."""
    headers = relayed_headers(call.info.request_id, att.backend_id, resp, "text/event-stream")
    _add_cached_tokens(headers, att)
    out = web.StreamResponse(status=resp.status, headers=headers)
    out.headers.setdefault("Cache-Control", "no-cache")
    sent: list[bytes] | None = [] if call.body is not None else None
    status, reason = await _stream(ctx, call, att, resp, out, first, sent)
    if reason is not None and sent is not None:
        return out, status, _Cut(reason, sent)
    if status != 200 and status != _CLIENT_GONE:
        await _stream_error_event(out, status)
    return out, status, None


async def _stream_error_event(out: web.StreamResponse, status: int) -> None:
    """End a cut stream with an explicit SSE error event, so no client waits on it."""
    message = "the backend failed mid-stream" if status == 502 else "the stream timed out"
    event = b"data: " + orjson.dumps(_upstream_error(status, message).to_body()) + b"\n\n"
    try:
        await out.write(event)
    except OSError:  # the client went away meanwhile
        return


async def _serve(
    ctx: ProxyContext, call: _Call, att: _Attempt, resp: UpstreamResponse, first: bytes
) -> web.StreamResponse:
    """Answer the client from an upstream response that will not be retried."""
    cut = None
    try:
        if resp.status == 200 and call.is_stream:
            out, status, cut = await _relay(ctx, call, att, resp, first)
        else:
            out, status = _whole_response(call, att, resp, first), resp.status
    except BaseException:  # cancelled (client gone) or a bug: ``_attempt`` accounts it
        resp.close()
        raise
    if status == resp.status:
        resp.release()
    else:
        resp.close()
    att.finish(ok=status < 500 and status != _CLIENT_GONE, status=status)
    if cut is not None:  # the failed attempt is accounted: continue elsewhere
        await _migrate(ctx, call, att.backend_id, out, cut, status)
    return out


async def _continue_on(
    ctx: ProxyContext, call: _Call, att: _Attempt, out: web.StreamResponse,
    sent: list[bytes], splicer: Splicer, payload: bytes,
) -> tuple[int, str | None]:  # fmt: skip
    """One continuation attempt (dispatched by the caller); accounted here."""
    got = await _try_backend(ctx, call, att, payload)
    if isinstance(got, _Failure):
        att.finish(ok=False, status=got.status)
        return got.status, "error"
    resp, first = got
    if resp.status != 200:
        resp.release()
        att.finish(ok=False, status=resp.status)
        retryable = _retryable_status(resp.status)
        return (resp.status if retryable else 502), ("error" if retryable else None)
    try:
        status, reason = await _stream(ctx, call, att, resp, out, first, sent, splicer)
    except BaseException:
        resp.close()
        raise
    if status == 200:
        resp.release()
    else:
        resp.close()
    att.finish(ok=status < 500 and status != _CLIENT_GONE, status=status)
    return status, reason


async def _migrate(
    ctx: ProxyContext, call: _Call, failed_id: str, out: web.StreamResponse, cut: _Cut,
    status: int,
) -> None:  # fmt: skip
    """Continue a cut stream on the next backends of the ranked list; when none
    succeeds, end it with the SSE error event."""
    assert call.body is not None
    failed = {failed_id}
    reason: str | None = cut.reason
    for _ in range(ctx.cfg.migration.max_attempts):
        if reason is None or call.loop.time() >= call.deadline:
            break
        delivered = parse_delivered(cut.sent)
        if delivered.done:  # the client has the whole stream: nothing to add
            return
        if delivered.has_other:
            break
        body = None
        if delivered.finish_reason is None:
            body = continuation_body(call.path, call.body, delivered)
        if body is None:  # every token was delivered: end the stream here
            end = end_events(delivered, call.info.input_tokens, with_usage=not call.strip_usage)
            with contextlib.suppress(OSError):
                await out.write(end)
            return
        backend_id = ctx.router.continuation(call.ranked, failed)
        if backend_id is None:
            break
        ctx.metrics.migration(reason, delivered.num_tokens)
        logger.warning(
            "request_id=%s backend=%s failed mid-stream (%s) after %d tokens; continuing on %s",
            call.info.request_id, failed_id, reason, delivered.num_tokens, backend_id,
        )  # fmt: skip
        att = _Attempt(ctx, call, backend_id)
        att.dispatch()
        splicer = Splicer(delivered, strip_usage=call.strip_usage)
        try:
            status, reason = await _continue_on(
                ctx, call, att, out, cut.sent, splicer, orjson.dumps(body)
            )
        except BaseException as exc:
            gone = isinstance(exc, asyncio.CancelledError | ConnectionError)
            att.finish(ok=False, status=_CLIENT_GONE if gone else 500)
            raise
        if status == 200 or status == _CLIENT_GONE:
            return
        failed.add(backend_id)
        failed_id = backend_id
    if status != _CLIENT_GONE:
        await _stream_error_event(out, 502 if status < 500 else status)


async def _attempt(
    ctx: ProxyContext, call: _Call, backend_id: str
) -> web.StreamResponse | _Failure:
    """One backend's try; accounted exactly once whatever happens (``finish`` is
    idempotent: the normal paths call it, and any exception lands here)."""
    att = _Attempt(ctx, call, backend_id)
    att.dispatch()
    try:
        got = await _try_backend(ctx, call, att)
        if isinstance(got, _Failure):
            att.finish(ok=False, status=got.status)
            return got
        resp, first = got
        elsewhere = call.hooks is not None and call.hooks.is_elsewhere(resp.status, first)
        if _retryable_status(resp.status) or elsewhere:
            resp.release()
            att.finish(ok=False, status=resp.status)
            headers = relayed_headers(call.info.request_id, backend_id, resp, "application/json")
            why = "previous_response_elsewhere" if elsewhere else f"http_{resp.status}"
            return _Failure(why, resp.status, first, headers)
        return await _serve(ctx, call, att, resp, first)
    except BaseException as exc:
        gone = isinstance(exc, asyncio.CancelledError | ConnectionError)
        att.finish(ok=False, status=_CLIENT_GONE if gone else 500)
        raise


async def forward(
    ctx: ProxyContext,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    raw: bytes,
    info: RequestInfo,
    decision: Decision,
    continue_on: tuple[str, ...] | None = None,
    deadline: float | None = None,
) -> web.StreamResponse:
    """Send the request to the decision's backends in rank order until one answers
    (a cut stream continues on ``continue_on``, default the same backends), by
    ``deadline`` (loop time; default ``request_timeout_s`` from now)."""
    loop = asyncio.get_running_loop()
    if deadline is None:
        deadline = loop.time() + ctx.cfg.request_timeout_s
    hooks: ApiHooks | None = request.get(HOOKS_KEY)  # an agent-era API's: sent as it came
    payload, is_stream, strip_usage = (
        stream_payload(body, raw) if hooks is None else (raw, body.get("stream") is True, False)
    )
    user = body.get("user")
    call = _Call(
        request, path, payload, info, user if isinstance(user, str) else None,
        is_stream, strip_usage, deadline, loop,
    )  # fmt: skip
    call.cached_blocks, call.hooks = decision.cached_blocks, hooks
    call.trace = request[TRACE_KEY] if ctx.is_traced else None
    mig = ctx.cfg.migration
    if (
        is_stream
        and mig.enabled
        and mig.max_attempts > 0
        and hooks is None
        and migratable(path, body)
        and migration_requested(request.headers.get(MIGRATE_HEADER))
    ):
        call.body, call.ranked = body, decision.ranked if continue_on is None else continue_on
    seeking = hooks is not None and hooks.seek_owner is not None  # every backend may hold it
    candidates = decision.ranked[: None if seeking else ctx.cfg.retries + 1]
    failure = _Failure("deadline_exceeded", status=504)
    backend_id = candidates[0]
    for i, backend_id in enumerate(candidates):
        if i > 0 and loop.time() >= call.deadline:
            break
        result = await _attempt(ctx, call, backend_id)
        if not isinstance(result, _Failure):
            return result
        failure = result
        if i + 1 < len(candidates):
            ctx.metrics.retry(backend_id, failure.reason.split(":")[0])
            logger.warning(
                "request_id=%s backend=%s failed before first byte (%s); retrying",
                info.request_id, backend_id, failure.reason,
            )  # fmt: skip
    return _failure_response(call, backend_id, failure)
