"""What the proxy needs to know of one agent-era API request (gateway/extra_apis.py).

The front door of ``/v1/responses``, ``/v1/messages``, ``/v1/embeddings``,
``/v1/rerank``, ``/tokenize`` and ``/detokenize`` puts an ``ApiHooks`` on the request;
the proxy (``gateway/proxy.py``) reads it: such requests are sent on unchanged (no
``stream_options`` added), a stream's first token is its first content event (the
``first_token_marker`` bytes, e.g. ``response.output_text.delta``) and its output tokens
are the number of those events, and ``on_data`` sees the answer's bytes (the Responses
API learns which backend produced a response id from them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["HOOKS_KEY", "ApiHooks"]


@dataclass(slots=True)
class ApiHooks:
    """One agent-era API request's hooks (absent on completions and chat)."""

    path: str
    first_token_marker: bytes | None = None  # streamed: the event that carries a token
    on_data: Callable[[str, bytes], None] | None = None  # (backend id, answer bytes)
    pinned_request_id: str | None = None  # set while ``Router.pins`` holds this request


# aiohttp >= 3.13 wants a RequestKey, older versions have none
HOOKS_KEY: Any = (
    web.RequestKey("kiloserve_api_hooks", ApiHooks)
    if hasattr(web, "RequestKey")
    else "kiloserve_api_hooks"
)
