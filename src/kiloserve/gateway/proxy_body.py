"""The proxy's two looks into JSON bodies: the request sent upstream (usage asked for on
streams) and the output tokens of a whole answer (gateway/proxy.py)."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["stream_payload", "usage_tokens"]


def usage_tokens(body: bytes) -> int:
    """``usage.completion_tokens`` (OpenAI) or ``output_tokens`` (Responses); 0 without."""
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return 0
    if not isinstance(usage, dict):
        return 0
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))  # OpenAI / Responses
    return tokens if isinstance(tokens, int) else 0


def stream_payload(body: dict[str, Any], raw: bytes) -> tuple[bytes, bool, bool]:
    """(bytes to send upstream, is_stream, strip_usage). Asks for usage on streams."""
    if not body.get("stream"):
        return raw, False, False
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("include_usage") is True:
        return raw, True, False
    new_opts = (
        {**opts, "include_usage": True} if isinstance(opts, dict) else {"include_usage": True}
    )
    return orjson.dumps({**body, "stream_options": new_opts}), True, True
