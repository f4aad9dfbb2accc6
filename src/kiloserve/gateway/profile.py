"""Request profiling (S1.1): build the ``RequestInfo`` a policy sees, in well under 5 ms.

* input tokens: a real ``tokenizers`` tokenizer when ``models.<name>.tokenizer`` is
  configured, else ``kiloserve.tokens.count_tokens`` on the prompt (completions) or on
  the message contents joined by newlines (chat). Token-id prompts count exactly.
  Token-id prompts are checked: ids are ints in 0..2^32-1 (bools are not), in a list or
  a list of lists (one level of nesting, as OpenAI's completions allow); else 400
  naming ``prompt``.
* predicted output tokens: ``max_tokens`` / ``max_completion_tokens`` when given, else
  an EWMA of actual output tokens per (user, model), else ``default_output_tokens``.
* session key: the ``x-session-id`` header, else the body's ``user``, else the ``sub``
  claim of a JWT bearer token. The JWT is only base64-decoded, NOT verified: the key is
  a routing hint (affinity), never an identity used for access control.
* bounded keys: a ``user`` / session id / model name longer than ``MAX_KEY_CHARS`` is
  kept only as ``bounded_key``'s digest of the whole value (stable across processes, so
  one user keeps its session, tenant and history; two long values sharing a prefix stay
  apart). So every per-user structure here (and downstream: affinity, tenant fair
  share) is bounded in bytes per entry as well as in entries, whatever clients send.
* prefix hashes: ``kiloserve.tokens.block_hashes`` over the first ``max_prefix_tokens``
  tokens (chained, so a capped prefix still identifies the shared prefix).
* large prompts (issue 15): ``profile_async`` gives the same ``RequestInfo`` without
  holding the event loop: a configured tokenizer runs in a worker thread (``tokenizers``
  releases the GIL), the approximation counts in steps of ``OFFLOAD_CHUNK_CHARS``
  characters (``kiloserve.tokens.chunk_bounds``) with a yield to the loop between them
  (the regex holds the GIL, so a thread would not help). The front door uses it for
  bodies over ``profile_offload_bytes``; small prompts stay on the synchronous path.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from kiloserve.errors import ConfigError, RequestError
from kiloserve.gateway.config import GatewayConfig
from kiloserve.policies.base import RequestInfo
from kiloserve.tokens import MAX_TOKEN_ID, block_hashes, chunk_bounds, count_tokens, tokenize

__all__ = [
    "MAX_KEY_CHARS",
    "OutputPredictor",
    "Profiler",
    "bounded_key",
    "jwt_subject",
    "prompt_text",
]

MAX_PIECE_CHARS = 5  # one optional leading space + 4 characters (see kiloserve.tokens)
MAX_KEY_CHARS = 128  # longer user / session / model keys are kept as a digest
OFFLOAD_CHUNK_CHARS = 16 * 1024  # profile_async counts this much text between yields
_DIGEST_PREFIX = "sha256:"


def bounded_key(value: str) -> str:
    """``value`` itself when at most ``MAX_KEY_CHARS`` long, else ``sha256:`` and 32 hex
    digits of a digest of all of it: the same for equal values in every process, apart
    for different ones (not truncated: long ids that share a prefix stay distinct)."""
    if len(value) <= MAX_KEY_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return _DIGEST_PREFIX + digest[:32]


class _Encoder(Protocol):
    def __call__(self, text: str) -> list[int]: ...


class OutputPredictor:
    """EWMA of actual output tokens per (user, model), bounded in size (LRU): at most
    ``max_num_keys`` entries, each keyed by ``bounded_key``s (a few hundred bytes per
    entry), whatever the raw ``user`` strings are."""

    def __init__(self, default_tokens: int, alpha: float = 0.2, max_num_keys: int = 100_000):
        self._default = default_tokens
        self._alpha = alpha
        self._max_num_keys = max_num_keys
        self._ewma: OrderedDict[tuple[str, str], float] = OrderedDict()

    @staticmethod
    def _key(user: str | None, model: str) -> tuple[str, str]:
        return bounded_key(user or ""), bounded_key(model)

    def predict(self, user: str | None, model: str) -> int:
        value = self._ewma.get(self._key(user, model))
        return self._default if value is None else max(1, round(value))

    def observe(self, user: str | None, model: str, output_tokens: int) -> None:
        key = self._key(user, model)
        old = self._ewma.pop(key, None)
        new = float(output_tokens) if old is None else old + self._alpha * (output_tokens - old)
        self._ewma[key] = new
        if len(self._ewma) > self._max_num_keys:
            self._ewma.popitem(last=False)


def _b64url(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def jwt_subject(authorization: str | None) -> str | None:
    """The ``sub`` claim of a ``Bearer <jwt>`` header, decoded without verification."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    parts = authorization[7:].strip().split(".")
    if len(parts) != 3:
        return None
    try:
        claims = orjson.loads(_b64url(parts[1]))
    except (binascii.Error, ValueError):
        return None
    sub = claims.get("sub") if isinstance(claims, dict) else None
    return str(sub) if isinstance(sub, str | int) and sub != "" else None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def _token_ids(ids: list[Any]) -> list[int]:
    """``ids`` when every item is a token id (an int in 0..2^32-1, not a bool), else a
    400 naming ``prompt`` (an id past 2^32-1 made ``block_hashes`` fail: a 500)."""
    if all(type(t) is int for t in ids):  # exact type: bools (ints too) are not ids
        if not ids or (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID):
            return ids
    elif any(isinstance(t, list) for t in ids):
        raise RequestError(
            "'prompt' nests lists too deeply: it is a string, a list of strings, a list "
            "of token ids or a list of lists of token ids",
            param="prompt",
        )
    raise RequestError(
        f"token ids in 'prompt' must be integers in 0..{MAX_TOKEN_ID}", param="prompt"
    )


def prompt_text(body: Mapping[str, Any]) -> str | list[int]:
    """The prompt as text (or token ids) from a completions or chat body; token ids are
    checked (``RequestError`` naming ``prompt``)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # bools too: the check names them
            return list(_token_ids(prompt))
        if isinstance(first, str):
            return "\n".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, list):  # a batch of token-id prompts (other items ignored)
            return [t for p in prompt if isinstance(p, list) for t in _token_ids(p)]
    return ""


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError("'max_tokens' must be a non-negative integer", param="max_tokens")
    return value


def _load_encoder(path: str) -> _Encoder:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - tokenizers is a dev dependency
        raise ConfigError("models.*.tokenizer needs the 'tokenizers' package") from exc
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:
        raise ConfigError(f"models.*.tokenizer: cannot load {path}: {exc}") from exc

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    return encode


async def count_tokens_yielding(text: str, chunk_chars: int = OFFLOAD_CHUNK_CHARS) -> int:
    """``count_tokens(text)``, counted in slices with a yield to the event loop after
    each (a few milliseconds of work per slice)."""
    total = 0
    for start, end in chunk_bounds(text, chunk_chars):
        total += count_tokens(text[start:end])
        await asyncio.sleep(0)
    return total


class Profiler:
    """Builds ``RequestInfo`` from a parsed body and headers."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self._block_size = cfg.block_size
        self._max_prefix_tokens = cfg.max_prefix_tokens
        self.outputs = OutputPredictor(cfg.default_output_tokens)
        self._encoders: dict[str, _Encoder] = {
            name: _load_encoder(m.tokenizer) for name, m in cfg.models.items() if m.tokenizer
        }

    def _tokens(self, model: str, prompt: str | list[int]) -> tuple[int, tuple[int, ...]]:
        """(input token count, prefix block hashes)."""
        if isinstance(prompt, list):
            ids = prompt
            return len(ids), tuple(block_hashes(ids[: self._max_prefix_tokens], self._block_size))
        encoder = self._encoders.get(model)
        if encoder is not None:
            ids = encoder(prompt)
            head = ids[: self._max_prefix_tokens]
            return len(ids), tuple(block_hashes(head, self._block_size))
        num_tokens = count_tokens(prompt)
        if num_tokens < self._block_size:  # not one full block: no hashes to compute
            return num_tokens, ()
        return num_tokens, self._approx_prefix_hashes(prompt)

    def _approx_prefix_hashes(self, text: str) -> tuple[int, ...]:
        max_chars = self._max_prefix_tokens * MAX_PIECE_CHARS
        # past max_chars the last piece may be cut: drop it, the rest is exact
        ids = tokenize(text) if len(text) <= max_chars else tokenize(text[:max_chars])[:-1]
        return tuple(block_hashes(ids[: self._max_prefix_tokens], self._block_size))

    async def _tokens_async(
        self, model: str, prompt: str | list[int]
    ) -> tuple[int, tuple[int, ...]]:
        """``_tokens``, leaving the event loop free while a long text is tokenised."""
        if isinstance(prompt, list):
            return self._tokens(model, prompt)
        encoder = self._encoders.get(model)
        if encoder is not None:
            ids = await asyncio.to_thread(encoder, prompt)
            head = ids[: self._max_prefix_tokens]
            return len(ids), tuple(block_hashes(head, self._block_size))
        num_tokens = await count_tokens_yielding(prompt)
        if num_tokens < self._block_size:
            return num_tokens, ()
        return num_tokens, self._approx_prefix_hashes(prompt)  # bounded: the prefix only

    def profile(
        self, request_id: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestInfo:
        max_tokens = _max_tokens(body)
        tokens = self._tokens(body["model"], prompt_text(body))
        return self._info(request_id, body, headers, max_tokens, tokens)

    async def profile_async(
        self, request_id: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestInfo:
        """``profile`` for large prompts: the same answer, without blocking the loop."""
        max_tokens = _max_tokens(body)
        prompt = prompt_text(body)
        tokens = await self._tokens_async(body["model"], prompt)
        return self._info(request_id, body, headers, max_tokens, tokens)

    def _info(
        self,
        request_id: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        max_tokens: int | None,
        tokens: tuple[int, tuple[int, ...]],
    ) -> RequestInfo:
        model = body["model"]
        user = body.get("user")
        # a long user is kept as its digest (stable): never the raw string (issue 15)
        user_key = bounded_key(user) if isinstance(user, str) and user else None
        input_tokens, hashes = tokens
        predicted = max_tokens if max_tokens is not None else self.outputs.predict(user_key, model)
        sid = headers.get("x-session-id")
        session = bounded_key(sid) if sid else user_key
        if session is None:
            sub = jwt_subject(headers.get("authorization"))
            session = bounded_key(sub) if sub is not None else None
        return RequestInfo(
            request_id=request_id,
            model=model,
            input_tokens=input_tokens,
            predicted_output_tokens=predicted,
            max_tokens=max_tokens,
            session_key=session,
            prefix_hashes=hashes,
            tenant=user_key,
        )
