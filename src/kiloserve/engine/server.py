"""The engine twin's HTTP API: a vLLM-compatible OpenAI server over ``TwinLoop``.

``create_app(config)`` builds the aiohttp application (tests and the simulator's parity
tests run it in-process); ``run_twin(config)`` serves it until SIGINT / SIGTERM.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream and not),
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``GET /version``,
``GET /metrics``, ``GET /node/metrics`` (the node's dcgm-exporter stand-in,
``engine/node_metrics.py``), ``GET|POST /admin/faults``; the agent-era APIs
(``/v1/responses``, ``/v1/messages``, ``/v1/embeddings``, ``/detokenize``) are in
``engine/agent_server.py``. Every error is an OpenAI-style JSON body;
bad input is a 4xx, and anything unexpected a 500 JSON (never a bare traceback).

KV-cache events (``TwinConfig.kv_events_endpoint``): the app's start-up binds the
twin's ZMQ publisher (``engine.kvpublish``) before the engine loop starts, and its
clean-up closes it after the loop stops; ``serve_twin`` logs the bound addresses.

``/admin/faults`` can crash or stall the twin, so a web page must not reach it through
the operator's browser (``kiloserve.httpguard``): a ``Host`` other than an IP address,
localhost, the bound host or an allowed name, a cross-origin ``Origin`` and a cross-site
fetch are 403, a POST whose body is not ``application/json`` is 400. With an admin
token (``kiloserve engine --admin-token`` or ``KILOSERVE_ADMIN_TOKEN``) it also needs
``Authorization: Bearer <token>`` (401).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import orjson
from aiohttp import web

from kiloserve import __version__
from kiloserve.engine.agent_server import add_agent_routes
from kiloserve.engine.core import StepTimer
from kiloserve.engine.disagg_routes import PLAIN, Leg, add_disagg_routes, leg_of
from kiloserve.engine.faults import FaultSet
from kiloserve.engine.http_body import read_json
from kiloserve.engine.lora_routes import (
    adapter_of,
    add_lora_routes,
    end_lora_request,
    start_lora_request,
)
from kiloserve.engine.parallel_sampling import generate_n
from kiloserve.engine.protocol import (
    DONE_EVENT,
    PROBE_HEADER,
    ChunkEncoder,
    GenerationRequest,
    TokenizeFn,
    next_stream_chunks,
    parse_chat,
    parse_completion,
    plan_output,
    render_chat_body,
)
from kiloserve.engine.shaped_output import ShapedChunkEncoder
from kiloserve.engine.tracing import TRACE_STREAM_KEY, install_twin_tracing
from kiloserve.engine.twin import (
    DisconnectWatcher,
    RequestStream,
    Twin,
    TwinConfig,
    Watched,
    build_twin,
)
from kiloserve.errors import ConfigError, NotFoundError, RequestError
from kiloserve.httpguard import HostPolicy, check_bearer, check_browser_request, is_loopback_host

__all__ = [
    "VLLM_VERSION",
    "TwinConfig",
    "TwinServer",
    "create_app",
    "run_twin",
    "serve_twin",
]

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
TWIN_KEY = web.AppKey("twin", Twin)
Parser = Callable[[object, TokenizeFn], GenerationRequest]
CrashFn = Callable[[int], None]
CRASH_KEY: web.AppKey[CrashFn] = web.AppKey("crash")
SHUTDOWN_TIMEOUT_S = 2.0
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# the twin speaks vLLM's dialect: its 404s are typed NotFoundError (kiloserve.errors and
# the gateway write not_found_error); other statuses keep their kiloserve.errors type
_VLLM_TYPES = {404: "NotFoundError"}


WATCHER_KEY = web.AppKey("watcher", DisconnectWatcher)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, message: str, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return _json(body, status)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], object]
) -> web.StreamResponse:
    """Turn every failure into an OpenAI-style JSON error with the right status."""
    try:
        response = await handler(request)  # type: ignore[misc]
        return response  # type: ignore[no-any-return]
    except RequestError as exc:
        return _json(exc.to_body(_VLLM_TYPES.get(exc.status)), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err_type = _VLLM_TYPES.get(exc.status, "invalid_request_error")
        return _error(exc.status, exc.reason, err_type)
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return _error(500, "internal error in the engine twin", "InternalServerError")


def _check_model(twin: Twin, model: str | None) -> None:
    if model is not None and model != twin.model_name and adapter_of(twin, model) is None:
        raise NotFoundError(f"The model `{model}` does not exist.", param="model")


async def _submit(
    twin: Twin, gen: GenerationRequest, entry: Watched, is_probe: bool = False, leg: Leg = PLAIN
) -> RequestStream:
    num_out, finish = plan_output(gen, twin.max_model_len)
    is_done = False
    try:
        stream = await twin.loop.submit(
            gen.prompt_token_ids, num_out, finish, is_notify_each_step=gen.is_stream,
            is_probe=is_probe, hold_request_id=leg.hold_request_id,
            num_transferred_tokens=leg.num_transferred_tokens, transfer_s=leg.transfer_s,
        )  # fmt: skip
        is_done = True
    finally:
        leg.submitted(is_done)  # a decode leg frees its prefill's KV (disagg_routes.py)
    entry.stream = stream
    if entry.gone.is_set():
        twin.loop.abort(stream)
    return stream


async def _generate(request: web.Request, parser: Parser) -> web.StreamResponse:
    twin = request.app[TWIN_KEY]
    body = await read_json(request)
    watcher = request.app[WATCHER_KEY]
    entry = watcher.watch(request)
    try:
        if twin.faults.faults.is_hang:
            await entry.gone.wait()  # accept, never answer
            return web.Response(status=499)
        status = twin.faults.draw_error_status()
        if status is not None:
            err_type = "InternalServerError" if status >= 500 else "invalid_request_error"
            return _error(status, "injected fault (kiloserve engine twin)", err_type)
        gen = parser(body, twin.tokenize)
        _check_model(twin, gen.model)
        leg = await leg_of(request, twin, body, len(gen.prompt_token_ids))  # P/D (KV pull)
        track_lora = start_lora_request(twin, gen.model)  # engine/lora_routes.py
        if gen.n > 1:  # one sequence per choice, as vLLM's parallel sampling
            return await generate_n(request, twin, gen, entry, PROBE_HEADER in request.headers)
        stream = await _submit(twin, gen, entry, PROBE_HEADER in request.headers, leg)
        track_lora(stream)
        if gen.is_stream:
            return await _send_stream(request, twin, gen, stream, entry)
        return await _send_full(twin, gen, stream, request, leg)
    finally:
        watcher.unwatch(request)
        if entry.stream is not None:
            request[TRACE_STREAM_KEY] = entry.stream  # the span's token counts (tracing.py)
            twin.loop.abort(entry.stream)
            end_lora_request(twin, entry.stream)


def _encoder(twin: Twin, gen: GenerationRequest) -> ChunkEncoder:
    prefix = "cmpl-" if gen.kind == "completion" else "chatcmpl-"
    args = (gen.kind, prefix + uuid.uuid4().hex, twin.model_name, int(time.time()))
    if gen.fields.is_plain:
        return ChunkEncoder(*args)
    return ShapedChunkEncoder(*args, gen.fields)  # engine/sampling_fields.py


async def _send_full(
    twin: Twin, gen: GenerationRequest, stream: RequestStream, request: web.Request, leg: Leg
) -> web.Response:
    while not stream.is_finished:
        await stream.wait_beyond(stream.num_generated_tokens)
    reason = stream.finish_reason or "abort"
    if reason == "abort":
        return web.Response(status=499)  # the client is gone; nobody reads this
    num_prompt = len(gen.prompt_token_ids)
    body = _encoder(twin, gen).full_response(
        num_prompt, stream.num_generated_tokens, reason, _num_cached(twin, stream)
    )
    body = leg.answer(body, stream, request)  # a prefill leg's kv_transfer_params
    return web.Response(body=body, content_type="application/json")


def _num_cached(twin: Twin, stream: RequestStream) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (``None``: the flag is off)."""
    if not twin.config.enable_prompt_tokens_details:
        return None
    return stream.num_cached_tokens


async def _send_stream(
    request: web.Request,
    twin: Twin,
    gen: GenerationRequest,
    stream: RequestStream,
    entry: Watched,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    encoder = _encoder(twin, gen)
    num_sent = 0
    # chat: the role chunk goes out with the first engine output, as vLLM's (not at once)
    role = encoder.role_chunk() if gen.kind == "chat" else b""
    with contextlib.suppress(ConnectionError):
        while True:
            await stream.wait_beyond(num_sent)
            if stream.finish_reason == "abort":
                return response
            data, num_sent, is_stalled = next_stream_chunks(
                encoder,
                num_sent,
                stream.num_generated_tokens,
                stream.finish_reason,
                twin.faults.faults.stall_after_tokens,
            )
            data, role = role + data, b""
            if is_stalled:
                await response.write(data)
                await entry.gone.wait()  # keep the connection open, send nothing more
                return response
            if stream.is_finished:
                break
            await response.write(data)
        if gen.include_usage:
            data += encoder.usage_chunk(
                len(gen.prompt_token_ids), stream.num_generated_tokens, _num_cached(twin, stream)
            )
        await response.write(data + DONE_EVENT)
        await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


async def models(request: web.Request) -> web.Response:
    twin = request.app[TWIN_KEY]
    card = {
        "id": twin.model_name,
        "object": "model",
        "created": twin.created_s,
        "owned_by": "kiloserve",
        "root": twin.model_name,
        "parent": None,
        "max_model_len": twin.max_model_len,
    }
    loras = twin.lora.model_cards(twin.created_s) if twin.lora is not None else []
    return _json({"object": "list", "data": [card, *loras]})


async def health(request: web.Request) -> web.Response:
    twin = request.app[TWIN_KEY]
    if twin.loop.failure is not None:
        return _error(500, "the engine twin loop has failed", "InternalServerError")
    if twin.faults.faults.is_hang:  # a hung engine's health check never answers
        watcher = request.app[WATCHER_KEY]
        try:
            await watcher.watch(request).gone.wait()
        finally:
            watcher.unwatch(request)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": VLLM_VERSION, "kiloserve": __version__})


async def tokenize(request: web.Request) -> web.Response:
    twin = request.app[TWIN_KEY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    _check_model(twin, body.get("model") if isinstance(body.get("model"), str) else None)
    if "messages" in body:
        ids = twin.tokenize(render_chat_body(body))
    elif isinstance(body.get("prompt"), str):
        ids = twin.tokenize(str(body["prompt"]))
    else:
        raise RequestError("give 'prompt' (a string) or 'messages'", param="prompt")
    return _json({"count": len(ids), "max_model_len": twin.max_model_len, "tokens": ids})


async def metrics(request: web.Request) -> web.Response:
    twin = request.app[TWIN_KEY]
    body = twin.metrics.render()
    if twin.lora is not None:
        body += twin.lora.render_metric().encode()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def node_metrics(request: web.Request) -> web.Response:
    body = request.app[TWIN_KEY].node.render()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def _admin_guard(token: str | None, policy: HostPolicy, handler: _Handler) -> _Handler:
    """The bearer token (when set), then the browser checks of ``kiloserve.httpguard``."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        if token is not None:
            check_bearer(request.headers.get("Authorization"), token)
        check_browser_request(request.method, request.headers, request.body_exists, policy)
        return await handler(request)

    return guarded


async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[TWIN_KEY].faults.faults.to_json())


async def post_faults(request: web.Request) -> web.StreamResponse:
    twin = request.app[TWIN_KEY]
    faults = FaultSet.from_json(await read_json(request))
    if faults.is_crash:
        logger.warning("crash fault requested: exiting with code 1")
        response = _json({"crash": True})
        await response.prepare(request)
        await response.write_eof()
        request.app[CRASH_KEY](1)
        return response
    twin.faults.replace(faults)
    logger.info("faults now %s", faults.to_json())
    return _json(faults.to_json())


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    twin = app[TWIN_KEY]
    publisher = twin.kv_publisher
    if publisher is not None:
        publisher.start()  # binds: a ConfigError naming the endpoint if it cannot
    twin.loop.start()
    watcher_task = asyncio.get_running_loop().create_task(app[WATCHER_KEY].run())
    yield
    watcher_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher_task
    await twin.loop.stop()
    if publisher is not None:
        await publisher.close()


def create_app(
    config: TwinConfig,
    *,
    timer: StepTimer | None = None,
    on_crash: CrashFn = os._exit,
    admin_token: str | None = None,
    admin_allowed_hosts: Iterable[str] = (),
) -> web.Application:
    """The twin's aiohttp application; raises ``DoesNotFitError`` / ``ConfigError``.

    ``timer`` replaces the roofline step-time model; ``on_crash`` is what the crash
    fault calls (``os._exit``; tests pass a recorder). ``admin_token``: when set,
    ``/admin/faults`` needs it as a bearer token; ``admin_allowed_hosts``: names
    (``name`` or ``name:port``) ``/admin/faults`` answers besides IP addresses,
    localhost and ``config.host``.
    """
    try:
        policy = HostPolicy.of(config.host, admin_allowed_hosts, "--admin-allowed-host")
    except ValueError as exc:
        raise ConfigError(f"--admin-allowed-host: {exc}") from exc
    twin = build_twin(config, timer)
    if admin_token is None and not is_loopback_host(config.host):
        logger.warning(
            "engine twin binds %s without --admin-token: anyone who can reach it may POST"
            " /admin/faults (slow it down, hang or crash it)",
            config.host,
        )
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024**2)
    app[TWIN_KEY] = twin
    app[WATCHER_KEY] = DisconnectWatcher(twin.loop)
    app[CRASH_KEY] = on_crash
    app.cleanup_ctx.append(_lifecycle)
    if config.otlp_traces_endpoint:  # a span per request (engine/tracing.py)
        install_twin_tracing(app, config.otlp_traces_endpoint, twin.model_name)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    add_agent_routes(app, twin, app[WATCHER_KEY])  # /v1/responses, /v1/messages, ...
    add_lora_routes(app, twin)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    add_disagg_routes(app, twin)  # /kv_transfer/release, /kv_transfer/info
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/node/metrics", node_metrics)
    app.router.add_get("/admin/faults", _admin_guard(admin_token, policy, get_faults))
    app.router.add_post("/admin/faults", _admin_guard(admin_token, policy, post_faults))
    return app


class TwinServer:
    """A twin served from this event loop on ``config.host:config.port`` (0 picks one).

    ``async with TwinServer(config) as server:`` then use ``server.url``. Used by
    ``run_twin``, the tests, and anyone who wants a twin in-process. Client
    disconnects abort requests with or without aiohttp's ``handler_cancellation``
    (without it, a watcher notices closed connections within 0.2 s).
    """

    def __init__(
        self,
        config: TwinConfig,
        *,
        timer: StepTimer | None = None,
        on_crash: CrashFn = os._exit,
        handler_cancellation: bool = True,
        admin_token: str | None = None,
        admin_allowed_hosts: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.app = create_app(
            config,
            timer=timer,
            on_crash=on_crash,
            admin_token=admin_token,
            admin_allowed_hosts=admin_allowed_hosts,
        )
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=handler_cancellation,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        self.url = ""

    @property
    def twin(self) -> Twin:
        return self.app[TWIN_KEY]

    async def start(self) -> str:
        """Bind and serve; returns the base URL (``http://host:port``)."""
        await self._runner.setup()
        host, port = self.config.host, self.config.port
        try:
            await web.TCPSite(self._runner, host, port).start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> TwinServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def serve_twin(
    config: TwinConfig,
    stop: asyncio.Event | None = None,
    *,
    admin_token: str | None = None,
    admin_allowed_hosts: Iterable[str] = (),
) -> None:
    """Serve until ``stop`` is set (or SIGINT / SIGTERM when ``stop`` is None)."""
    server = TwinServer(config, admin_token=admin_token, admin_allowed_hosts=admin_allowed_hosts)
    async with server:
        twin = server.twin
        logger.info(
            "engine twin %s (%s on %d x %s, role %s) listening on %s",
            twin.model_name,
            config.model,
            config.tp,
            config.gpu,
            config.role,
            server.url,
        )
        publisher = twin.kv_publisher
        if publisher is not None:
            logger.info(
                "KV events published on %s, replay on %s",
                publisher.endpoint,
                publisher.replay_endpoint or "(none)",
            )
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("engine twin shutting down")


def run_twin(
    config: TwinConfig,
    *,
    admin_token: str | None = None,
    admin_allowed_hosts: Iterable[str] = (),
) -> int:
    """Run a twin in this process until SIGINT / SIGTERM; returns the exit code."""
    asyncio.run(
        serve_twin(config, admin_token=admin_token, admin_allowed_hosts=admin_allowed_hosts)
    )
    return 0
