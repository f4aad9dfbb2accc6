"""Front-door checks of a request body's fields (``gateway/app.py``): 400s naming them."""

from __future__ import annotations

from typing import Any

from kiloserve.errors import RequestError

__all__ = ["check_stream_fields"]


def _type_name(value: Any) -> str:
    """A JSON type name for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def check_stream_fields(body: dict[str, Any]) -> None:
    """``stream`` a boolean and ``stream_options`` an object (or null): the proxy reads
    both to ask the backend for usage, and would otherwise rewrite or misread them."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(
            f"Invalid type for 'stream': expected a boolean, but got {_type_name(stream)}",
            param="stream",
        )
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise RequestError(
            f"Invalid type for 'stream_options': expected an object, but got {_type_name(opts)}",
            param="stream_options",
        )
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise RequestError(
            "Invalid type for 'stream_options.include_usage': expected a boolean, but got "
            f"{_type_name(usage)}",
            param="stream_options.include_usage",
        )
