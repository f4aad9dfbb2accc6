"""The gateway's one error answer: an aiohttp middleware over ``kiloserve.errors``.

A handler (front door, admission gate, proxy, admin API) raises a ``RequestError``
(or a subclass: the tree is drawn in ``kiloserve/errors.py``); ``error_middleware``
answers it with the error's status and the OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``, the request's ``x-request-id``,
``Retry-After`` when the error carries one (429 / 503) and the error's own headers
(``x-kiloserve-backend`` on a 502 / 504). Counting a refused request in the metrics
stays with the code that refuses it (it knows the model label).

Not here: a backend's own answer (its 4xx, or its 5xx / 429 after the last retry) is
relayed unchanged by the proxy, and a stream cut mid-way ends with an SSE error event
(``proxy._stream_error_event``), since its status line has already been sent.
Anything else a handler raises goes on to aiohttp, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kiloserve.errors import RequestError
from kiloserve.gateway.proxy import REQUEST_ID_HEADER

__all__ = ["error_middleware", "error_response"]


def error_response(exc: RequestError, request_id: str) -> web.Response:
    """The JSON answer to ``exc``."""
    headers = {REQUEST_ID_HEADER: request_id, **exc.response_headers()}
    return web.Response(
        body=orjson.dumps(exc.to_body()), status=exc.status, headers=headers,
        content_type="application/json",
    )  # fmt: skip


def error_middleware(request_id: Callable[[web.Request], str]) -> Middleware:
    """The middleware; ``request_id(request)`` is the id the handler used (or a new one)."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as exc:
            return error_response(exc, request_id(request))

    return errors
