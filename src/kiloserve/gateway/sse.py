"""Server-sent-event relay bookkeeping: forward bytes as they come, find the usage chunk.

Bytes are never re-encoded. Complete events (up to the last ``\\n\\n`` seen) are passed
on as received; only a batch that mentions ``"usage"`` is split into events, and the
usage event (``"usage": {...}`` with no choices, as vLLM sends for
``stream_options.include_usage``) is parsed for token counts and dropped when the
client did not ask for it.
"""

from __future__ import annotations

import orjson

__all__ = ["SseRelay"]

_SEP = b"\n\n"
_CRLF_SEP = b"\r\n\r\n"
MAX_PENDING_BYTES = 1 << 20  # an event larger than this is passed on unsplit
_USAGE = b'"usage"'
_NULL_USAGE = (b'"usage":null', b'"usage": null')


def _event_end(buf: bytes) -> int:
    """Index just past the last complete event in ``buf`` (-1 if none)."""
    lf = buf.rfind(_SEP)
    if lf >= 0:
        return lf + 2
    crlf = buf.rfind(_CRLF_SEP)  # backends that end lines with CRLF
    return crlf + 4 if crlf >= 0 else -1


class SseRelay:
    """Feed upstream chunks, get the bytes to forward; usage counts are collected."""

    __slots__ = (
        "_buf", "_count", "completion_tokens", "num_events", "prompt_tokens", "strip_usage",
    )  # fmt: skip

    def __init__(self, *, strip_usage: bool, count: bytes | None = None) -> None:
        """``count``: what ``num_events`` counts (default: ``data:`` lines, one per event;
        the agent-era APIs count their content events, gateway/api_hooks.py)."""
        self.strip_usage = strip_usage
        self._count = count if count is not None else b"data:"
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.num_events = 0
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes of every event completed by ``chunk`` (possibly empty)."""
        buf = self._buf + chunk if self._buf else chunk
        cut = _event_end(buf)
        if cut < 0:
            if len(buf) <= MAX_PENDING_BYTES:
                self._buf = buf
                return b""
            cut = len(buf)
        if cut == len(buf):  # the usual case: the chunk ends on an event boundary
            done, self._buf = buf, b""
        else:
            done, self._buf = buf[:cut], buf[cut:]
        if _USAGE in done:
            done = self._filter_usage(done)
        self.num_events += done.count(self._count)
        return done

    def flush(self) -> bytes:
        """Whatever is left when the upstream stream ends (normally nothing)."""
        rest, self._buf = self._buf, b""
        return rest

    def _filter_usage(self, data: bytes) -> bytes:
        sep = _SEP if _SEP in data else _CRLF_SEP
        kept = []
        for event in data.split(sep):
            if not event:
                continue
            if _USAGE in event and self._is_usage_event(event) and self.strip_usage:
                continue
            kept.append(event + sep)
        return b"".join(kept)

    def _is_usage_event(self, event: bytes) -> bool:
        if any(n in event for n in _NULL_USAGE):
            return False
        start = event.find(b"data:")
        if start < 0:
            return False
        try:
            obj = orjson.loads(event[start + 5 :])
        except orjson.JSONDecodeError:
            return False
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if not isinstance(usage, dict):
            return False
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        self.completion_tokens = completion if isinstance(completion, int) else None
        self.prompt_tokens = prompt if isinstance(prompt, int) else None
        return not obj.get("choices")
