"""Mid-stream failover (request migration): pure functions the proxy uses on failure.

When a streamed completion's backend crashes or stalls after tokens reached the client,
the proxy continues the generation on another backend (docs/gateway.md, "Mid-stream
failover"):

* ``parse_delivered`` reads, only then, the SSE events already written to the client
  (the proxy keeps their bytes; nothing is parsed on the hot path): the text delivered,
  how many tokens (content-bearing chunks), the stream's ``id`` / ``created`` /
  ``model``, whether a finish reason, the usage chunk or ``[DONE]`` went out;
* ``continuation_body`` rewrites the client's request: completions get prompt + text
  delivered, chat gets the text as a final assistant message with vLLM's
  ``continue_final_message: true, add_generation_prompt: false``; ``max_tokens`` is
  reduced by the tokens delivered; usage is always asked for;
* ``Splicer`` rewrites the continuation's events so the client sees one stream: the
  first stream's ``id`` / ``created`` / ``model``, no second chat role chunk, and the
  usage chunk counting the original prompt once (the continuation's prompt tokens less
  the tokens replayed) and every token delivered as completion tokens.

``migratable`` says which requests may be migrated at all: streamed, one choice, a
text prompt (not token ids), no ``echo`` / ``logprobs`` / ``best_of`` / tools.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MIGRATE_HEADER",
    "Delivered",
    "MigrationConfig",
    "Splicer",
    "continuation_body",
    "end_events",
    "migratable",
    "migration_requested",
    "parse_delivered",
    "stall_timeout_s",
]

MIGRATE_HEADER = "x-kiloserve-migrate"
_OFF = frozenset(("0", "false", "off", "no"))
_DONE = b"[DONE]"


class MigrationConfig(BaseModel):
    """``migration:`` in the gateway config (docs/gateway.md, "Mid-stream failover")."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_attempts: int = Field(default=2, ge=0)  # continuations per request
    stall_detection: bool = True  # cut (and migrate) a stream silent for the stall timeout
    stall_timeout_s: float | None = Field(default=None, gt=0.0)  # None: derived, below
    stall_floor_s: float = Field(default=5.0, gt=0.0)
    stall_tpot_factor: float = Field(default=20.0, gt=0.0)


def stall_timeout_s(cfg: MigrationConfig, ewma_tpot_ms: float | None) -> float:
    """``stall_timeout_s`` when set, else max(floor, factor x the backend's TPOT EWMA)."""
    if cfg.stall_timeout_s is not None:
        return cfg.stall_timeout_s
    if ewma_tpot_ms is None:
        return cfg.stall_floor_s
    return max(cfg.stall_floor_s, cfg.stall_tpot_factor * ewma_tpot_ms / 1000.0)


def migration_requested(header: str | None) -> bool:
    """False when the client sent ``x-kiloserve-migrate: 0`` (or false / off / no)."""
    return header is None or header.strip().lower() not in _OFF


def _is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def migratable(path: str, body: dict[str, Any]) -> bool:
    """Whether a streamed request may be continued elsewhere (see the module docstring)."""
    if not body.get("stream"):
        return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if body.get("echo") or body.get("logprobs") or body.get("top_logprobs"):
        return False
    if _is_chat(path):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return False
        return not any(k in body for k in ("tools", "functions", "continue_final_message"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str)


@dataclass(slots=True)
class Delivered:
    """What the client already has of a stream (parsed from the bytes written)."""

    text: str = ""
    num_tokens: int = 0
    id: str | None = None
    created: int | None = None
    model: str | None = None
    role_sent: bool = False
    finish_reason: str | None = None
    usage_sent: bool = False
    done: bool = False
    has_other: bool = False  # tool calls or anything else text cannot carry


def _events(data: bytes) -> list[bytes]:
    sep = b"\n\n" if b"\n\n" in data else b"\r\n\r\n"
    return [e.strip() for e in data.split(sep) if e.strip()]


def _event_json(event: bytes) -> Any:
    start = event.find(b"data:")
    if start < 0:
        return None
    payload = event[start + 5 :].strip()
    if payload == _DONE:
        return _DONE
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def parse_delivered(sent: Iterable[bytes]) -> Delivered:
    """Read the events written to the client (complete events, as relayed)."""
    d = Delivered()
    parts: list[str] = []
    for event in _events(b"".join(sent)):
        obj = _event_json(event)
        if obj is _DONE:
            d.done = True
            continue
        if not isinstance(obj, dict):
            continue
        if d.id is None and isinstance(obj.get("id"), str):
            d.id, d.created, d.model = obj["id"], obj.get("created"), obj.get("model")
        if obj.get("usage"):
            d.usage_sent = True
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                d.role_sent = d.role_sent or "role" in delta
                d.has_other = d.has_other or bool(delta.get("tool_calls"))
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                parts.append(text)
                d.num_tokens += 1
            if choice.get("finish_reason"):
                d.finish_reason = choice["finish_reason"]
    d.text = "".join(parts)
    return d


def continuation_body(
    path: str, body: dict[str, Any], delivered: Delivered
) -> dict[str, Any] | None:
    """The request that continues ``body`` after ``delivered``; None when no token is
    left to generate (the proxy then ends the stream itself)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)  # a P/D decode leg's: the continuation recomputes
    out["stream"] = True
    opts = body.get("stream_options")
    out["stream_options"] = (
        {**opts, "include_usage": True} if isinstance(opts, dict) else {"include_usage": True}
    )
    keys = ("max_completion_tokens", "max_tokens") if _is_chat(path) else ("max_tokens",)
    for key in keys:
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            left = limit - delivered.num_tokens
            if left <= 0:
                return None
            out[key] = left
    if _is_chat(path):
        prefix = {"role": "assistant", "content": delivered.text}
        out["messages"] = [*body["messages"], prefix]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            prompt = prompt[0]
        out["prompt"] = prompt + delivered.text
    return out


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def end_events(delivered: Delivered, prompt_tokens: int, *, with_usage: bool) -> bytes:
    """The end of a stream whose every token was delivered: usage (when the client
    asked and has none yet) and ``[DONE]``."""
    out = b""
    if with_usage and not delivered.usage_sent:
        chunk: dict[str, Any] = {"id": delivered.id, "created": delivered.created}
        chunk.update(model=delivered.model, choices=[])
        chunk["usage"] = _usage(prompt_tokens, delivered.num_tokens)
        out += _data(chunk)
    return out + b"data: [DONE]\n\n"


class Splicer:
    """Rewrites a continuation's complete SSE events into the client's stream."""

    __slots__ = ("completion_tokens", "delivered", "prompt_tokens", "strip_usage")

    def __init__(self, delivered: Delivered, *, strip_usage: bool) -> None:
        self.delivered = delivered
        self.strip_usage = strip_usage
        self.prompt_tokens: int | None = None  # the original prompt, once usage is seen
        self.completion_tokens: int | None = None  # every token, once usage is seen

    def feed(self, data: bytes) -> bytes:
        """The client's bytes for the continuation's complete events ``data``."""
        out = []
        for event in _events(data):
            obj = _event_json(event)
            if obj is _DONE:
                out.append(b"data: [DONE]\n\n")
                continue
            if not isinstance(obj, dict):
                out.append(event + b"\n\n")  # a comment or unknown line: as received
                continue
            kept = self._rewrite(obj)
            if kept is not None:
                out.append(_data(kept))
        return b"".join(out)

    def _rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        d = self.delivered
        if d.id is not None:
            obj["id"], obj["created"], obj["model"] = d.id, d.created, d.model
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self.prompt_tokens = max(0, prompt - d.num_tokens)
                self.completion_tokens = d.num_tokens + completion
                obj["usage"] = _usage(self.prompt_tokens, self.completion_tokens)
            if not obj.get("choices"):
                return None if self.strip_usage else obj
            if self.strip_usage:
                obj["usage"] = None
        if d.role_sent:
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
                    is_empty = not delta.get("content") and not choice.get("finish_reason")
                    if is_empty and len(obj["choices"]) == 1 and len(delta) <= 1:
                        return None
        return obj
