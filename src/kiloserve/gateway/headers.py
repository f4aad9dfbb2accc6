"""Header pass-through, as a transparent proxy does it (docs/gateway.md, "Header
pass-through").

Both ways everything passes but the hop-by-hop headers (RFC 9110 section 7.6.1, and any
header a ``Connection`` header names) and what the gateway sets itself. Filtering is a
frozenset lookup on lower-cased raw names: no regex, no re-encoding of what passes.
"""

from __future__ import annotations

from aiohttp import web

from kiloserve.gateway.upstream import UpstreamResponse, header_tokens

__all__ = [
    "BACKEND_HEADER",
    "CACHED_TOKENS_HEADER",
    "HOP_BY_HOP",
    "REQUEST_ID_HEADER",
    "Pairs",
    "client_headers",
    "forwarded_drop",
    "relayed_headers",
]

BACKEND_HEADER = "x-kiloserve-backend"
CACHED_TOKENS_HEADER = "x-kiloserve-prefix-cached-tokens"
REQUEST_ID_HEADER = "x-request-id"
_CLIENT_GONE = 499

# Hop-by-hop headers (RFC 9110 section 7.6.1): never passed on, either way.
HOP_BY_HOP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
     b"transfer-encoding", b"upgrade")
)  # fmt: skip
# Client -> engine: the gateway sets Host, Content-Length, Content-Type (the body may
# be rewritten) and x-request-id itself; it has already answered any Expect; it reads
# the engine's answers (usage, SSE events), so it asks for no compression.
_NOT_FORWARDED = HOP_BY_HOP | {
    b"host", b"content-length", b"content-type", b"expect", b"accept-encoding",
    b"content-encoding",  # the body the gateway sends on is the decoded one
    b"x-request-id",
}  # fmt: skip
# With gateway API keys on, the client's key is the gateway's secret (S6.1).
_NOT_FORWARDED_WITH_KEYS = _NOT_FORWARDED | {b"authorization"}
# Engine -> client: the body is re-framed (Content-Length), Content-Type is set once,
# the gateway's own ids win, and Date / Server are the gateway's (as nginx does).
_NOT_RELAYED = HOP_BY_HOP | {
    b"content-length", b"content-type", b"x-request-id", b"x-kiloserve-backend",
    b"x-kiloserve-prefix-cached-tokens",
    b"date", b"server",
}  # fmt: skip
# ``Connection`` values that name no other header (the common case: no set to build)
_PLAIN_CONNECTION = frozenset(("keep-alive", "close"))
Pairs = list[tuple[str, str]]


def forwarded_drop(*, has_keys: bool) -> frozenset[bytes]:
    """The client headers never forwarded to an engine (``authorization`` too when the
    gateway has API keys)."""
    return _NOT_FORWARDED_WITH_KEYS if has_keys else _NOT_FORWARDED


def client_headers(request: web.Request, drop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """The client's raw headers for the engine: all but ``drop`` and those its
    ``Connection`` header names."""
    connection = request.headers.get("Connection")
    if connection is not None and connection.lower() not in _PLAIN_CONNECTION:
        drop = drop | header_tokens(connection.encode("latin-1"))
    return [(name, value) for name, value in request.raw_headers if name.lower() not in drop]


def relayed_headers(
    request_id: str, backend_id: str, resp: UpstreamResponse, default_type: str
) -> Pairs:
    """The engine's headers for the client: all but the hop-by-hop ones and what the
    gateway sets; then Content-Type and the gateway's own two headers."""
    drop = _NOT_RELAYED
    if resp.connection_tokens:
        drop = drop | resp.connection_tokens
    headers = [
        (name.decode("latin-1"), value.decode("utf-8", "replace"))
        for name, value in resp.headers
        if name not in drop
    ]
    headers += [
        ("Content-Type", resp.content_type or default_type),
        (REQUEST_ID_HEADER, request_id),
        (BACKEND_HEADER, backend_id),
    ]
    return headers
