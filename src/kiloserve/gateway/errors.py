"""The gateway's one error answer: an aiohttp middleware over ``kiloserve.errors``.

A handler (front door, admission gate, proxy, admin API) raises a ``RequestError``
(or a subclass: the tree is drawn in ``kiloserve/errors.py``); ``error_middleware``
answers it with the error's status and the OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``, the request's ``x-request-id``,
``Retry-After`` when the error carries one (429 / 503) and the error's own headers
(``x-kiloserve-backend`` on a 502 / 504). Counting a refused request in the metrics
stays with the code that refuses it (it knows the model label).

aiohttp's own HTTP errors go the same way: a ``web.HTTPException`` of status 4xx / 5xx
(unknown URL 404, wrong method 405 with its ``Allow`` header, ``client_max_size``'s
413, ...) becomes the tree's class for its status (``http_error``); redirects and other
non-error ``HTTPException``s pass through untouched.

Not here: a backend's own answer (its 4xx, or its 5xx / 429 after the last retry) is
relayed unchanged by the proxy, and a stream cut mid-way ends with an SSE error event
(``proxy._stream_error_event``), since its status line has already been sent.

Requests too malformed to reach any handler (bad request line or headers, a body that
cannot be de-chunked or decompressed) are answered by aiohttp's protocol handler itself
(``web_protocol.RequestHandler.handle_error``: a plain-text 400 and a closed
connection; it has no hook for the body short of replacing aiohttp's ``Server``). What
this module controls is their log: ``ProtocolErrorLog``, passed to that handler as its
``logger`` (``web.Application(handler_args=...)``), turns the ERROR-with-traceback
aiohttp writes for each such request into at most one WARNING per interval, so a client
cannot flood the log. Exceptions that are not the client's fault keep their traceback.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from kiloserve.errors import (
    BadGatewayError,
    ForbiddenError,
    GatewayTimeoutError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RequestError,
    TooManyRequestsError,
    UnauthorizedError,
    UnavailableError,
    clip,
)
from kiloserve.gateway.headers import REQUEST_ID_HEADER

__all__ = ["ProtocolErrorLog", "error_middleware", "error_response", "http_error"]

# aiohttp's HTTPException status -> the tree's class for it (other 4xx: the 400 base)
_BY_STATUS: Mapping[int, type[RequestError]] = {
    400: RequestError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: PayloadTooLargeError,
    429: TooManyRequestsError,
    502: BadGatewayError,
    503: UnavailableError,
    504: GatewayTimeoutError,
}
# headers of an aiohttp HTTPException that describe its own text body, not the error
_BODY_HEADERS = frozenset(h.lower() for h in (hdrs.CONTENT_TYPE, hdrs.CONTENT_LENGTH))


def error_response(exc: RequestError, request_id: str) -> web.Response:
    """The JSON answer to ``exc``."""
    headers = {REQUEST_ID_HEADER: request_id, **exc.response_headers()}
    return web.Response(
        body=orjson.dumps(exc.to_body()), status=exc.status, headers=headers,
        content_type="application/json",
    )  # fmt: skip


def http_error(request: web.Request, exc: web.HTTPException) -> RequestError | None:
    """The tree's error for aiohttp's ``exc`` (None: not an error, let it through).

    Client values quoted in the message (method, path) are ``clip``ped; headers such as
    ``Allow`` are kept. A 4xx the tree has no class for is answered as the 400 base
    (``invalid_request_error``) with its own status, named in ``code``."""
    status = exc.status
    if status < 400 or (status >= 500 and status not in _BY_STATUS):
        return None
    where = f"{request.method} {clip(request.path)}"
    headers = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
    cls = _BY_STATUS.get(status)
    if status == 404:
        return NotFoundError(f"Invalid URL ({where})", code="unknown_url", headers=headers)
    if status == 405:
        allowed = headers.get(hdrs.ALLOW, "")
        return MethodNotAllowedError(
            f"Invalid method for URL ({where}); allowed: {allowed or 'none'}",
            code="method_not_allowed",
            headers=headers,
        )
    if status == 413:
        limit = request.client_max_size
        return PayloadTooLargeError(f"request body over the {limit}-byte limit", headers=headers)
    if cls is None:  # e.g. a 411: the 400 base (the middleware keeps the status)
        return RequestError(f"{exc.reason} ({where})", code=f"http_{status}", headers=headers)
    return cls(f"{exc.reason} ({where})", headers=headers)


def error_middleware(request_id: Callable[[web.Request], str]) -> Middleware:
    """The middleware; ``request_id(request)`` is the id the handler used (or a new one)."""

    def answer(request: web.Request, err: RequestError, status: int) -> web.Response:
        resp = error_response(err, request_id(request))
        if status != err.status:  # an unlisted 4xx: keep aiohttp's status
            resp.set_status(status)
        if request.content.exception() is not None:
            # the body could not be read (bad gzip, bad chunking): aiohttp closes this
            # connection after the answer, so say so rather than offer keep-alive
            resp.force_close()
        return resp

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as exc:
            return answer(request, exc, exc.status)
        except web.HTTPException as exc:
            err = http_error(request, exc)
            if err is None:
                raise
            return answer(request, err, exc.status)

    return errors


def _exception_of(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        value = exc_info[1]
        return value if isinstance(value, BaseException) else None
    if exc_info is True:
        return sys.exc_info()[1]
    return None


def _is_client_fault(exc: BaseException | None) -> bool:
    """A malformed request: aiohttp's HTTP parser refused it (``HttpProcessingError``:
    bad request line, header, framing, content coding) or its body could not be read
    (``RequestPayloadError``: bad chunking, bad gzip, cut short)."""
    return isinstance(exc, HttpProcessingError | web.RequestPayloadError)


class ProtocolErrorLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger for one app, rate-limiting malformed-request records.

    aiohttp logs every request it cannot parse (and every body it cannot decode) at
    ERROR with a traceback. Records whose exception is the client's fault become one
    WARNING (no traceback) per ``interval_s``, saying how many were left out; the rest
    are DEBUG. Everything else passes through unchanged."""

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})
        self.interval_s = interval_s
        self._clock = clock
        self._next_warning_s = -math.inf
        self.num_suppressed = 0

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc = _exception_of(kwargs.get("exc_info"))
        if level < logging.WARNING or not _is_client_fault(exc):
            super().log(level, msg, *args, **kwargs)
            return
        assert exc is not None
        now = self._clock()
        detail = clip(str(exc).replace("\n", " "), 200)
        if now < self._next_warning_s:
            self.num_suppressed += 1
            self.logger.debug("malformed request (%s: %s)", type(exc).__name__, detail)
            return
        self._next_warning_s = now + self.interval_s
        left_out, self.num_suppressed = self.num_suppressed, 0
        self.logger.warning(
            "malformed HTTP request answered 4xx (%s: %s); %d more since the last such "
            "warning not logged; at most one warning per %.0f s",
            type(exc).__name__, detail, left_out, self.interval_s,
        )  # fmt: skip
