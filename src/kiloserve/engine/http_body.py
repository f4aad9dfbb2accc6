"""Request bodies of the twin's routes: JSON, with the twin's 400 when it is not."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from kiloserve.errors import RequestError

__all__ = ["read_json", "read_json_object"]


async def read_json(request: web.Request) -> object:
    """The body parsed as JSON (``RequestError``, a 400, when it is not JSON)."""
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (a 400 for invalid JSON or any other JSON value)."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body
