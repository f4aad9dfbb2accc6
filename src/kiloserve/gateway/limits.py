"""Slow clients and resource caps of the gateway's HTTP server (issue 15).

aiohttp's server has no header or body read timeout and keeps an idle keep-alive
connection for an hour; nothing bounds the connections or the request bodies held in
memory. This module adds what the gateway needs (docs/gateway.md, "Limits and
timeouts"):

* ``GatewayRunner`` (an ``AppRunner``; ``make_runner(app, cfg)``): its protocol handler
  closes a connection that has not sent a complete request head within
  ``client_header_timeout_s`` (from the accept, or from the first byte of the next
  request on a keep-alive connection), and closes at once every connection past
  ``max_connections`` (one rate-limited WARNING, no answer: reading a request to answer
  503 would cost what the cap protects).
* ``BodyBudget``: bytes of request bodies held at once (being read or proxied), reserved
  before a body is read (``Content-Length``) or as it arrives (chunked); the front door
  answers 503 when a body does not fit.
* ``accept_error_filter``: the event loop's exception handler for the gateway: an accept
  that fails for lack of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM, logged
  by asyncio with a traceback per attempt) becomes at most one WARNING per interval.

The idle keep-alive timeout is aiohttp's own ``keepalive_timeout`` (``handler_args`` of
the app, so every runner gets it); the body read timeout is the front door's (app.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from kiloserve.errors import ERROR_TYPES, clip
from kiloserve.gateway.config import GatewayConfig

__all__ = [
    "BodyBudget",
    "GatewayRunner",
    "RateLimitedWarning",
    "accept_error_filter",
    "effective_max_connections",
    "make_runner",
]

logger = logging.getLogger(__name__)

# descriptors kept for upstream connections, scrapes, logs and files when
# ``max_connections`` is derived from RLIMIT_NOFILE (half of the rest go to clients:
# each proxied request also holds one upstream connection)
_FD_RESERVE = 64
_MIN_DERIVED_CONNECTIONS = 8
_MAX_DERIVED_CONNECTIONS = 1_000_000
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def effective_max_connections(cfg: GatewayConfig) -> int:
    """``cfg.max_connections``, else half of the soft ``RLIMIT_NOFILE`` left after a
    reserve of 64 descriptors (at least 8)."""
    if cfg.max_connections is not None:
        return cfg.max_connections
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 1024
    if soft == resource.RLIM_INFINITY or soft > 2 * _MAX_DERIVED_CONNECTIONS:
        return _MAX_DERIVED_CONNECTIONS
    return max(_MIN_DERIVED_CONNECTIONS, (soft - _FD_RESERVE) // 2)


class RateLimitedWarning:
    """At most one WARNING per ``interval_s`` for one kind of event; the next one says
    how many were left out (those go to DEBUG)."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self.interval_s = interval_s
        self._clock = clock
        self._next_s = -math.inf
        self.num_suppressed = 0

    def __call__(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now < self._next_s:
            self.num_suppressed += 1
            self._log.debug(msg, *args)
            return
        self._next_s = now + self.interval_s
        left_out, self.num_suppressed = self.num_suppressed, 0
        self._log.warning(
            msg + "; %d more since the last such warning not logged (at most one per %.0f s)",
            *args, left_out, self.interval_s,
        )  # fmt: skip


class BodyBudget:
    """Bytes of request bodies the gateway holds at once, capped at ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_reading = 0  # requests whose body is being read (not yet in flight)

    def try_reserve(self, num_bytes: int) -> bool:
        """Reserve ``num_bytes`` when they fit (True), else reserve nothing (False)."""
        if self.num_bytes + num_bytes > self.max_bytes:
            return False
        self.num_bytes += num_bytes
        return True

    def release(self, num_bytes: int) -> None:
        self.num_bytes -= num_bytes


class _Limits:
    """What one server's connections share: the caps and the live connection count."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.header_timeout_s = cfg.client_header_timeout_s
        self.max_connections = effective_max_connections(cfg)
        self.num_connections = 0
        self.warn_refused = RateLimitedWarning(logger)
        self.warn_header_timeout = RateLimitedWarning(logger)


class _GuardedHandler(RequestHandler):
    """aiohttp's protocol handler with a request-head timeout and a connection cap."""

    __slots__ = ("_header_handle", "_limits", "_refused")

    def __init__(self, manager: Server, limits: _Limits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._refused = False
        self._header_handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limits = self._limits
        if limits.num_connections >= limits.max_connections:
            self._refused = True
            transport.close()
            limits.warn_refused(
                "connection refused: %d client connections open (max_connections)",
                limits.num_connections,
            )
            return
        limits.num_connections += 1
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._limits.num_connections -= 1
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages or self._request_in_progress:
            self._cancel_header_timer()
        elif data and self._header_handle is None:
            self._arm_header_timer()  # the first bytes of the next request's head

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (bad request line, headers,
        framing): logged as aiohttp does (through the gateway's rate-limited protocol
        log), answered as an OpenAI-style JSON error instead of plain text."""
        plain = super().handle_error(request, status, exc, message)
        if not 400 <= status < 500:
            return plain
        text = clip(message or HTTPStatus(status).phrase)
        body = {
            "error": {
                "message": f"malformed HTTP request: {text}",
                "type": ERROR_TYPES.get(status, ERROR_TYPES[400]),
                "param": None,
                "code": "bad_http_request",
            }
        }
        resp = web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
        resp.force_close()
        return resp

    def _arm_header_timer(self) -> None:
        self._header_handle = self._loop.call_later(
            self._limits.header_timeout_s, self._header_timed_out
        )

    def _cancel_header_timer(self) -> None:
        if self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None

    def _header_timed_out(self) -> None:
        self._header_handle = None
        waiter = self._waiter
        # only while start() waits for a request head (a request being handled is not cut)
        if (
            waiter is not None
            and not waiter.done()
            and not self._messages
            and not self._request_in_progress
            and self.transport is not None
        ):
            self._limits.warn_header_timeout(
                "client connection closed: no complete request head within %.1f s "
                "(client_header_timeout_s)",
                self._limits.header_timeout_s,
            )
            self.force_close()


class _GuardedServer(Server):
    def __init__(self, limits: _Limits, handler: Any, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._limits = limits

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, self._limits, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An ``AppRunner`` whose connections get the gateway's head timeout and cap."""

    def __init__(self, app: web.Application, cfg: GatewayConfig, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = _Limits(cfg)

    async def _make_server(self) -> Server:
        plain = await super()._make_server()  # the app's own server: startup has run
        return _GuardedServer(
            self._limits,
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **plain._kwargs,  # the runner's and the app's handler arguments
        )


def make_runner(app: web.Application, cfg: GatewayConfig, **kwargs: Any) -> GatewayRunner:
    """The runner ``kiloserve gateway`` uses (``handler_cancellation=True``, no access
    log, plus ``kwargs``), with the limits of ``cfg``; embedders should use it too."""
    options: dict[str, Any] = {"handler_cancellation": True, "access_log": None, **kwargs}
    return GatewayRunner(app, cfg, **options)


def accept_error_filter(
    previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None,
    *,
    interval_s: float = 60.0,
) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler: accept failures for lack of resources become
    one WARNING per ``interval_s``; everything else goes to ``previous`` (or the loop's
    default handler)."""
    warn = RateLimitedWarning(logger, interval_s=interval_s)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            warn(
                "cannot accept connections: %s (%s); asyncio retries every second; "
                "raise the descriptor limit (ulimit -n) or lower max_connections",
                exc.strerror or exc, context.get("message", ""),
            )  # fmt: skip
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    return handle
