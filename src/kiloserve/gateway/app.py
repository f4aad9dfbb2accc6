"""The gateway application factory and its front-door handlers.

``create_gateway_app(cfg)`` returns an aiohttp ``Application``; its startup hook opens
one pooled upstream ``ClientSession`` and starts model discovery, the scrape loop and
the KV-event subscriber (``gateway/kvevents.py``), and its cleanup hook stops them. Run
it with ``handler_cancellation=True`` (as ``kiloserve gateway`` does) so a client that
disconnects while waiting for a non-streaming answer also closes the upstream request.
Handlers raise the errors of ``kiloserve.errors``; one middleware (``gateway/errors.py``)
answers them, aiohttp's own HTTP errors included, and the app hands aiohttp's protocol
handler a rate-limited logger (``ProtocolErrorLog``) for requests too malformed to reach
a handler.

The front door checks what the proxy relies on: the body decodes (``Content-Encoding``
none / identity / gzip / deflate, or br / zstd where aiohttp can decode them), is a JSON
object with a ``model``, ``stream`` is a boolean and ``stream_options`` an object;
anything else is a 400 naming the field.

Limits (issue 15; docs/gateway.md, "Limits and timeouts"): ``max_in_flight`` and
``max_buffered_body_bytes`` are checked before a body is read (503 ``overloaded``), a
body that stalls for ``client_body_timeout_s`` closes its connection, idle keep-alive
connections close after ``keepalive_timeout_s``, and bodies over
``profile_offload_bytes`` (or ``EXACT_OFFLOAD_BYTES`` when a real tokenizer is configured)
are profiled without holding the event loop. Run the app with
``make_runner(app, cfg)`` (``gateway/limits.py``) for the request-head timeout and the
connection cap, which live in the protocol handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kiloserve.errors import (
    ConfigError,
    NotFoundError,
    PayloadTooLargeError,
    RequestError,
    UnavailableError,
    clip,
)
from kiloserve.gateway.admin import LIVE_CONFIG_KEY, add_admin_routes, config_hash
from kiloserve.gateway.admission.auth import ApiKey, KeyStore
from kiloserve.gateway.admission.gate import FLOW_KEY, install_flow_control
from kiloserve.gateway.body_checks import check_stream_fields
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.dashboard import add_dashboard_routes
from kiloserve.gateway.dashboard_state import DashboardRecorder
from kiloserve.gateway.disagg import forward_split, plan_split
from kiloserve.gateway.errors import ProtocolErrorLog, error_middleware
from kiloserve.gateway.extra_apis import api_view, install_extra_apis
from kiloserve.gateway.headers import REQUEST_ID_HEADER
from kiloserve.gateway.heap import load_malloc_trim, trim_loop
from kiloserve.gateway.inventory import install_inventory
from kiloserve.gateway.kvevents import KvEventSubscriber
from kiloserve.gateway.limits import BodyBudget, accept_error_filter, make_runner
from kiloserve.gateway.lora import LORA_KEY, install_lora
from kiloserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from kiloserve.gateway.model_cards import ModelCardCache
from kiloserve.gateway.output_history import install_output_history
from kiloserve.gateway.peers import PEERS_KEY, install_peers
from kiloserve.gateway.profile import Profiler
from kiloserve.gateway.proxy import ProxyContext, forward
from kiloserve.gateway.registry.watch import start_registry
from kiloserve.gateway.reload import RELOAD_KEY, Reloader
from kiloserve.gateway.resilience.manager import Resilience
from kiloserve.gateway.scrape import scrape_loop
from kiloserve.gateway.tracing import TRACE_KEY, install_tracing
from kiloserve.gateway.upstream import UpstreamPool
from kiloserve.gateway.worker_metrics import WorkerMetrics
from kiloserve.policies.base import Decision, Policy, RequestInfo
from kiloserve.policies.prefix_index import PrefixIndex
from kiloserve.routing.router import Router
from kiloserve.routing.shared_load import SharedLoad
from kiloserve.routing.table import BackendTable

__all__ = [
    "BODY_BUDGET_KEY",
    "CTX_KEY",
    "KV_EVENTS_KEY",
    "METRICS_KEY",
    "SCRAPE_SHARE_KEY",
    "TABLE_KEY",
    "WORKER_METRICS_KEY",
    "create_gateway_app",
    "create_policy_for",
    "make_runner",
]

logger = logging.getLogger(__name__)

# A real tokenizer (exact mode) costs ~1-5 us per token: bodies past this size are
# tokenised in a worker thread even under ``profile_offload_bytes`` (issue 14).
EXACT_OFFLOAD_BYTES = 4 * 1024


class _RequestIds:
    """Request ids unique per app: a random prefix and a counter (cheaper than uuid4)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex() + "-"
        self._counter = itertools.count(1)

    def next(self) -> str:
        return self._prefix + str(next(self._counter))


CTX_KEY = web.AppKey("kiloserve_gateway_ctx", ProxyContext)
TABLE_KEY = web.AppKey("kiloserve_gateway_table", BackendTable)
WORKER_METRICS_KEY = web.AppKey("kiloserve_gateway_worker_metrics", WorkerMetrics)
# (the workers' shared scrapes, is this worker the scraper): set by gateway/cli.py
SCRAPE_SHARE_KEY = web.AppKey("kiloserve_gateway_scrape_share", tuple[SharedLoad, bool])
METRICS_KEY = web.AppKey("kiloserve_gateway_metrics", GatewayMetrics)
_TASKS_KEY = web.AppKey("kiloserve_gateway_tasks", list)
_SESSION_KEY = web.AppKey("kiloserve_gateway_session", aiohttp.ClientSession)
_IDS_KEY = web.AppKey("kiloserve_gateway_ids", _RequestIds)
_CARDS_KEY = web.AppKey("kiloserve_gateway_model_cards", ModelCardCache)
RESILIENCE_KEY = web.AppKey("kiloserve_gateway_resilience", Resilience)
BODY_BUDGET_KEY = web.AppKey("kiloserve_gateway_bodies", BodyBudget)
KV_EVENTS_KEY = web.AppKey("kiloserve_gateway_kv_events", KvEventSubscriber)
_LOOP_HANDLER_KEY = web.AppKey("kiloserve_gateway_loop_handler", list)
_MAX_REQUEST_ID_CHARS = 128
# the request's id, kept on the request; aiohttp >= 3.13 wants a RequestKey, older has none
_RID_KEY: Any = (
    web.RequestKey("kiloserve_request_id", str)
    if hasattr(web, "RequestKey")
    else "kiloserve_request_id"
)


def create_policy_for(cfg: GatewayConfig) -> Policy:
    """The policy named in ``cfg.policy`` from the policy registry."""
    try:
        from kiloserve.policies.registry import create_policy
    except ImportError as exc:
        raise ConfigError("policy registry (kiloserve.policies.registry) is missing") from exc
    policy: Policy = create_policy(cfg.policy.name, dict(cfg.policy.params))
    return policy


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _request_id(request: web.Request) -> str:
    """The client's ``x-request-id`` when printable and short, else a new one; the same
    for one request however often asked (the error middleware asks again)."""
    rid: str | None = request.get(_RID_KEY)
    if rid is None:
        rid = request.headers.get(REQUEST_ID_HEADER)
        if not (rid and len(rid) <= _MAX_REQUEST_ID_CHARS and rid.isprintable()):
            rid = request.app[_IDS_KEY].next()
        request[_RID_KEY] = rid
    return rid


# Content-Encodings aiohttp decodes (br / zstd only with their packages: without them
# aiohttp itself refuses the request with a 400 before any handler runs)
_DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


async def _body_chunks(request: web.Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The decoded body's chunks; ``TimeoutError`` when none comes for ``timeout_s``."""
    content = request.content
    while True:
        if content.is_eof():  # the rest is buffered already: no wait, no timer
            chunk = await content.readany()
        else:
            async with asyncio.timeout(timeout_s):
                chunk = await content.readany()
        if not chunk:
            return
        yield chunk


def _overloaded(what: str) -> UnavailableError:
    return UnavailableError(
        f"the gateway is at its {what} limit; retry later", code="overloaded", retry_after_s=1
    )


async def _read_body(request: web.Request, cfg: GatewayConfig, budget: BodyBudget) -> bytes:
    """The decoded body, read only when it fits ``max_buffered_body_bytes`` (reserved
    from ``Content-Length`` before reading, chunked bodies as they arrive; on success
    ``len(body)`` stays reserved for the caller to release). A client that sends
    nothing for ``client_body_timeout_s`` is disconnected."""
    max_body_bytes = cfg.max_body_bytes
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise PayloadTooLargeError(f"request body over the {max_body_bytes}-byte limit")
    encoding = request.headers.get("Content-Encoding", "")
    if not (encoding.isascii() and encoding.lower() in _DECODED_ENCODINGS):
        # aiohttp passes a body in an unknown coding through undecoded: refuse it here
        raise RequestError(
            f"unsupported Content-Encoding `{clip(encoding, 64)}`: send the body "
            "uncompressed, or gzip / deflate encoded",
            code="unsupported_content_encoding",
        )
    reserved = length or 0
    if not budget.try_reserve(reserved):
        raise _overloaded("buffered request body (max_buffered_body_bytes)")
    chunks: list[bytes] = []
    num_bytes = 0
    budget.num_reading += 1
    try:
        try:
            async for chunk in _body_chunks(request, cfg.client_body_timeout_s):
                num_bytes += len(chunk)
                if num_bytes > max_body_bytes:
                    raise PayloadTooLargeError(f"request body over the {max_body_bytes}-byte limit")
                if num_bytes > reserved:  # chunked, or decoded past its Content-Length
                    if not budget.try_reserve(num_bytes - reserved):
                        raise _overloaded("buffered request body (max_buffered_body_bytes)")
                    reserved = num_bytes
                chunks.append(chunk)
        except TimeoutError as exc:
            # the client stopped sending: close its connection (no one would read an answer)
            request.protocol.force_close()
            raise RequestError(
                f"no request body bytes for {cfg.client_body_timeout_s:g} s "
                "(client_body_timeout_s); connection closed",
                code="client_body_timeout",
            ) from exc
        except web.RequestPayloadError as exc:  # bad gzip / deflate, bad chunking, cut short
            reason = clip(str(exc).replace("\n", " ").strip(), 200)
            raise RequestError(
                f"the request body could not be read or decoded ({reason}); check its "
                "Content-Encoding and framing",
                code="invalid_body",
            ) from exc
    except BaseException:
        budget.release(reserved)
        raise
    finally:
        budget.num_reading -= 1
    budget.release(reserved - num_bytes)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _parse_body(
    raw: bytes, pick: Callable[[dict[str, Any], Any], bool], headers: Any
) -> tuple[dict[str, Any], bytes]:
    """(body, the bytes to send on): ``pick`` may set the model from a header or a
    verified JWT claim (gateway/model_select.py); then the body is re-encoded."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"invalid JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    if pick(body, headers):
        raw = orjson.dumps(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("you must provide a 'model' parameter", param="model")
    check_stream_fields(body)
    return body, raw


async def _check_model(app: web.Application, model: str, rid: str, key: ApiKey | None) -> None:
    """404 when no backend serves ``model`` and it is no known LoRA adapter; 403 when the
    API key may not use it, before any adapter load on its behalf; a known adapter no
    backend holds is then loaded (404 when that fails)."""
    table = app[TABLE_KEY]
    lora = app.get(LORA_KEY)
    if table.serves(model) or (lora is not None and model in lora.catalog):
        KeyStore.check_model(key, model)
        if lora is not None:
            await lora.ensure(model, rid)
    if not table.serves(model):
        served = ", ".join(table.served_models()) or "(none yet)"
        raise NotFoundError(
            f"The model `{clip(model)}` does not exist. Served models: {served}",
            param="model",
            code="model_not_found",
        )


async def _proxy(request: web.Request, path: str) -> web.StreamResponse:
    ctx = request.app[CTX_KEY]
    rid = _request_id(request)
    flow = request.app.get(FLOW_KEY)  # API keys, limits, admission (admission/gate.py)
    budget = request.app[BODY_BUDGET_KEY]
    cfg = ctx.cfg
    try:
        key = flow.authenticate(request.headers) if flow is not None else None
        # before the body is read: a refused request costs no body memory
        if ctx.num_in_flight + budget.num_reading >= cfg.max_in_flight:
            raise _overloaded("in-flight (max_in_flight)")
        raw = await _read_body(request, cfg, budget)
    except RequestError as exc:  # answered by the error middleware (gateway/errors.py)
        ctx.metrics.request_done("", "", exc.status)
        raise
    try:  # len(raw) stays reserved in the body budget until the request is done
        try:
            size = len(raw)
            if size <= cfg.profile_offload_bytes and not (  # the hot path: all synchronous
                size > EXACT_OFFLOAD_BYTES and ctx.profiler.has_tokenizers
            ):
                body, sent = _parse_body(raw, ctx.profiler.pick_model, request.headers)
                await _check_model(request.app, body["model"], rid, key)
                info = ctx.profiler.profile(rid, api_view(request, body, rid), request.headers)
            else:  # a large prompt: let other requests run between the long steps
                await asyncio.sleep(0)
                body, sent = _parse_body(raw, ctx.profiler.pick_model, request.headers)
                await _check_model(request.app, body["model"], rid, key)
                await asyncio.sleep(0)
                view = api_view(request, body, rid)  # agent-era APIs: a chat-shaped view
                info = await ctx.profiler.profile_async(rid, view, request.headers)
            if flow is not None:
                info = flow.classify(key, info, request.headers)
        except RequestError as exc:
            ctx.metrics.request_done("", "", exc.status)
            raise

        def dispatch(decision: Decision | None) -> Awaitable[web.StreamResponse]:
            return _dispatch(request, path, body, sent, info, decision)

        if ctx.is_traced:  # OpenTelemetry spans (gateway/tracing.py)
            request[TRACE_KEY].profiled(info, queued=flow is not None)

        if flow is not None:
            return await flow.guard(info, key, dispatch)
        return await dispatch(None)
    finally:
        budget.release(len(raw))


async def _dispatch(
    request: web.Request,
    path: str,
    body: dict[str, Any],
    raw: bytes,
    info: RequestInfo,
    decision: Decision | None,
) -> web.StreamResponse:
    """Forward along ``decision`` (admission's, with its reserved backend first), or
    along the router's decision when admission is off: one ``choose`` either way."""
    ctx = request.app[CTX_KEY]
    if ctx.num_in_flight >= ctx.cfg.max_in_flight:
        ctx.metrics.request_done(info.model, "", 503)
        raise _overloaded("in-flight (max_in_flight)")
    split = plan_split(ctx, request, path, body, info, decision)  # P/D (gateway/disagg.py)
    if decision is None:
        decision = split.prefill if split else ctx.router.decide(info, time.monotonic())
    if ctx.is_traced:
        request[TRACE_KEY].decided(decision)
    if not decision.ranked:
        ctx.metrics.request_done(info.model, "", 503)
        raise UnavailableError(
            f"no healthy backend for model `{info.model}`; retry later",
            code="no_backend",
            retry_after_s=1,
        )
    ctx.num_in_flight += 1
    try:
        if split is not None:
            return await forward_split(ctx, request, path, body, raw, info, split)
        return await forward(ctx, request, path, body, raw, info, decision)
    finally:
        ctx.num_in_flight -= 1


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/chat/completions")


async def list_models(request: web.Request) -> web.Response:
    app, cfg = request.app, request.app[CTX_KEY].cfg
    data = await app[_CARDS_KEY].get(
        app[_SESSION_KEY], app[TABLE_KEY], cfg.connect_timeout_s, cfg.model_cards_ttl_s
    )
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    doc: dict[str, object] = {"ready": request.app[TABLE_KEY].is_ready()}
    siblings = request.app.get(WORKER_METRICS_KEY)  # --workers N: ready when all of them are
    if doc["ready"] and siblings is not None and request.query.get("local") != "1":
        waiting = await siblings.not_ready()
        if waiting:
            doc = {"ready": False, "workers_not_ready": waiting}
    return _json(doc, status=200 if doc["ready"] else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    merged = request.app.get(WORKER_METRICS_KEY)  # --workers N: the whole gateway's page
    if merged is not None and request.query.get("local") != "1":
        body = (await merged.render(body.decode())).encode()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _discover_once(
    session: aiohttp.ClientSession, table: BackendTable, timeout_s: float
) -> None:
    async def one(backend_id: str) -> None:
        url = table.url_of(backend_id) + "/v1/models"
        try:
            async with asyncio.timeout(timeout_s), session.get(url) as resp:
                data = await resp.json(loads=orjson.loads, content_type=None)
            models = [m["id"] for m in data["data"] if isinstance(m.get("id"), str)]
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as exc:
            logger.info("model discovery for backend %s failed: %s", backend_id, type(exc).__name__)
            return
        table.set_models(backend_id, models)

    ids = [b for b in table.backend_ids() if table.record(b).needs_discovery]
    await asyncio.gather(*(one(b) for b in ids))


async def _discovery_loop(
    session: aiohttp.ClientSession, table: BackendTable, cfg: GatewayConfig
) -> None:
    while True:
        await _discover_once(session, table, max(cfg.scrape_timeout_s, cfg.connect_timeout_s))
        pending = any(not table.record(b).is_discovered for b in table.backend_ids())
        await asyncio.sleep(
            min(0.5, cfg.discovery_interval_s) if pending else cfg.discovery_interval_s
        )


def _needs_discovery(table: BackendTable) -> bool:
    return any(table.record(b).needs_discovery for b in table.backend_ids())


async def _on_startup(app: web.Application) -> None:
    ctx = app[CTX_KEY]
    # accept() failing for lack of descriptors: one WARNING a minute, not a traceback each
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    app[_LOOP_HANDLER_KEY][:] = [previous, accept_error_filter(previous)]
    loop.set_exception_handler(app[_LOOP_HANDLER_KEY][1])
    cfg = ctx.cfg
    connector = aiohttp.TCPConnector(limit=100, limit_per_host=4)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    app[_SESSION_KEY] = session
    tasks = app[_TASKS_KEY]
    if _needs_discovery(ctx.table):
        await _discover_once(session, ctx.table, cfg.connect_timeout_s)
    # always: a reload may add backends to discover (gateway/reload.py)
    tasks.append(asyncio.create_task(_discovery_loop(session, ctx.table, cfg)))
    share = app.get(SCRAPE_SHARE_KEY)  # --workers N: worker 0 scrapes for all (scrape.py)
    scraping = scrape_loop(
        session, ctx.table, cfg.scrape_interval_s, cfg.scrape_timeout_s,
        share[0] if share else None, is_scraper=share is None or share[1],
    )  # fmt: skip
    tasks.append(asyncio.create_task(scraping))
    trim = load_malloc_trim() if cfg.malloc_trim_interval_s > 0 else None
    if trim is not None:
        tasks.append(asyncio.create_task(trim_loop(cfg.malloc_trim_interval_s, trim)))
    app[RESILIENCE_KEY].start(session, random.Random(cfg.seed))
    registry_task = start_registry(cfg, ctx.table, ctx.metrics, share[0] if share else None)
    if registry_task is not None:
        tasks.append(registry_task)
    app[KV_EVENTS_KEY].start()
    logger.info(
        "gateway policy=%s backends=%d", ctx.router.policy_name, len(ctx.table.backend_ids())
    )


async def _on_cleanup(app: web.Application) -> None:
    handlers = app[_LOOP_HANDLER_KEY]
    loop = asyncio.get_running_loop()
    if handlers and loop.get_exception_handler() is handlers[1]:
        loop.set_exception_handler(handlers[0])
    tasks = app[_TASKS_KEY]
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    tasks.clear()
    await app[KV_EVENTS_KEY].close()
    await app[RESILIENCE_KEY].close()
    await app[CTX_KEY].upstream.close()
    if _SESSION_KEY in app:
        await app[_SESSION_KEY].close()


def _tokenizer_modes(profiler: Profiler) -> Callable[[], dict[str, str]]:
    """The profiler's model -> "exact" / "approximate" (``{}`` from a profiler without)."""
    modes: Callable[[], dict[str, str]] | None = getattr(profiler, "tokenizer_modes", None)
    return modes if modes is not None else dict


def _prefix_index_fill(policy: Policy) -> Callable[[], tuple[int, int] | None]:
    """(blocks, cap) of ``policy``'s approximate prefix index; None when it keeps none."""

    def fill() -> tuple[int, int] | None:
        index = getattr(policy, "index", None)
        if not isinstance(index, PrefixIndex):
            return None
        return index.num_blocks, index.max_num_blocks

    return fill


def create_gateway_app(cfg: GatewayConfig, *, policy: Policy | None = None) -> web.Application:
    """Build the gateway app; ``policy`` overrides ``cfg.policy`` (tests, embedding)."""
    table = BackendTable(cfg)
    gw_metrics = GatewayMetrics(table, config_hash=config_hash(cfg))
    chosen = policy if policy is not None else create_policy_for(cfg)
    router = Router(table, chosen, random.Random(cfg.seed), block_size=cfg.block_size)
    router.decision_listeners.append(
        lambda _info, decision, ranked: gw_metrics.decision(decision.policy, ranked[0])
    )
    profiler = Profiler(cfg)
    gw_metrics.tokenizer_modes = _tokenizer_modes(profiler)
    gw_metrics.tokenizer_piece_cache = profiler.tokenizer_piece_cache
    gw_metrics.prefix_index_fill = _prefix_index_fill(chosen)
    ctx = ProxyContext(
        cfg=cfg,
        upstream=UpstreamPool(cfg.connect_timeout_s, cfg.max_idle_connections),
        table=table,
        metrics=gw_metrics,
        router=router,
        profiler=profiler,
        dashboard=DashboardRecorder(cfg.dashboard) if cfg.dashboard.enabled else None,
    )
    app = web.Application(
        client_max_size=cfg.max_body_bytes,
        middlewares=[error_middleware(_request_id)],
        # aiohttp's protocol handler logs malformed requests through this (rate-limited)
        handler_args={
            "logger": ProtocolErrorLog(),
            # idle keep-alive connections (aiohttp's default: 3,630 s)
            "keepalive_timeout": cfg.keepalive_timeout_s,
        },
    )
    app[CTX_KEY] = ctx
    app[TABLE_KEY] = table
    app[METRICS_KEY] = gw_metrics
    app[_TASKS_KEY] = []
    app[_IDS_KEY] = _RequestIds()
    app[_CARDS_KEY] = ModelCardCache()
    app[RESILIENCE_KEY] = Resilience(cfg, router, gw_metrics)
    app[BODY_BUDGET_KEY] = BodyBudget(cfg.max_buffered_body_bytes)
    app[_LOOP_HANDLER_KEY] = []
    kv_events = KvEventSubscriber(table, gw_metrics, block_size=cfg.block_size)
    app[KV_EVENTS_KEY] = kv_events
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(
        app,
        cfg,
        table,
        chosen.name,
        kv_events=kv_events.describe,
        tokenizer_modes=gw_metrics.tokenizer_modes,
        tokenizer_piece_cache=gw_metrics.tokenizer_piece_cache,
    )
    add_dashboard_routes(app, ctx, app[RESILIENCE_KEY].describe)
    install_flow_control(app, ctx, cfg)
    app[RELOAD_KEY] = Reloader(  # POST /admin/reload and SIGHUP (gateway/reload.py)
        ctx, app[LIVE_CONFIG_KEY], app[BODY_BUDGET_KEY], app[RESILIENCE_KEY],
        lambda: app.get(FLOW_KEY),
        lambda p: setattr(gw_metrics, "prefix_index_fill", _prefix_index_fill(p)),
    )  # fmt: skip
    peers_url = cfg.peers_redis_url()
    if cfg.peers.enabled and peers_url is not None:  # gateway/peers.py
        install_peers(app, cfg.peers, peers_url, table, gw_metrics.registry)
    install_output_history(app, cfg, profiler, gw_metrics.registry)  # shared through Redis
    install_inventory(app, table, cfg)  # engine and model versions (S5.5)
    install_lora(app, cfg.lora, table, router, cfg.discovery_interval_s, cfg.connect_timeout_s)
    # /v1/responses, /v1/messages, ... (issue 18); Responses ids shared with the peers
    install_extra_apis(app, _proxy, router, peers=app.get(PEERS_KEY))
    ctx.is_traced = install_tracing(app, cfg.tracing)  # OpenTelemetry spans (issue 18)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app
