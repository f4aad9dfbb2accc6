"""What the proxy needs to know of one agent-era API request (gateway/extra_apis.py).

The front door of ``/v1/responses``, ``/v1/messages``, ``/v1/embeddings``,
``/v1/rerank``, ``/tokenize`` and ``/detokenize`` puts an ``ApiHooks`` on the request;
the proxy (``gateway/proxy.py``) reads it: such requests are sent on unchanged (no
``stream_options`` added), a stream's first token is its first content event (the
``first_token_marker`` bytes, e.g. ``response.output_text.delta``) and its output tokens
are the number of those events, and ``on_data`` sees the answer's bytes (the Responses
API learns which backend produced a response id from them).

A Responses follow-up whose ``previous_response_id`` the gateway does not know
(``seek_owner``: learnt before a restart, through another gateway without ``peers``,
or in a peer message still on its way) goes to the policy's choice, and a backend
that does not hold the conversation answers 404 ("Response with id '...' not found.",
vLLM's words). ``is_elsewhere`` tells the proxy so: it tries the pool's other backends
in the policy's order, before any byte reaches the client, and relays the last 404 only
when none holds it.
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
    seek_owner: bytes | None = None  # a previous_response_id with no known backend

    def is_elsewhere(self, status: int, body: bytes) -> bool:
        """The backend does not hold the conversation ``seek_owner`` continues."""
        seek = self.seek_owner
        return seek is not None and status == 404 and seek in body and b"not found" in body


# aiohttp >= 3.13 wants a RequestKey, older versions have none
HOOKS_KEY: Any = (
    web.RequestKey("kiloserve_api_hooks", ApiHooks)
    if hasattr(web, "RequestKey")
    else "kiloserve_api_hooks"
)
