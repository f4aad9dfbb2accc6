"""Request profiling (S1.1): build the ``RequestInfo`` a policy sees, in well under 5 ms.

* input tokens (docs/gateway.md, "Tokens"): exact when ``models.<name>.tokenizer`` is
  configured: the ids vLLM computes (``kiloserve.gateway.chat_template``: completions
  encoded with the tokenizer's special tokens, chat rendered with the model's chat
  template and encoded without them; ``add_special_tokens`` in the body overrides
  both). Else approximate: ``kiloserve.tokens`` on the prompt (completions) or on the
  engine twin's chat rendering (``render_chat_body``), so the ids equal the twin's.
  Token-id prompts count exactly. They are checked: ids are ints in 0..2^32-1 (bools
  are not), in a list or a list of lists (one level of nesting, as OpenAI's
  completions allow); else 400 naming ``prompt``.
* model: the body's, or a header / verified JWT claim (``model_from``,
  ``kiloserve.gateway.model_select``; ``Profiler.pick_model``, before profiling).
* predicted output tokens: ``max_tokens`` / ``max_completion_tokens`` when given, else
  an EWMA of actual output tokens per (user, model), else ``default_output_tokens``;
  shared by every gateway through Redis when one is configured
  (``kiloserve.gateway.output_history``).
* session key: the ``x-session-id`` header, else the body's ``user``, else the ``sub``
  claim of a JWT bearer token. The JWT is only base64-decoded, NOT verified: the key is
  a routing hint (affinity), never an identity used for access control.
* bounded keys: a ``user`` / session id / model name longer than ``MAX_KEY_CHARS`` is
  kept only as ``bounded_key``'s digest of the whole value (stable across processes, so
  one user keeps its session, tenant and history; two long values sharing a prefix stay
  apart). So every per-user structure here (and downstream: affinity, tenant fair
  share) is bounded in bytes per entry as well as in entries, whatever clients send.
* prefix hashes: ``kiloserve.tokens.prefix_block_hashes`` over the first
  ``max_prefix_tokens`` tokens (chained, so a capped prefix still identifies the shared
  prefix), seeded with ``cache_seed(cache_salt=...)``: vLLM's ``cache_salt`` body field
  (checked as vLLM does: a non-empty string of at most 128 characters without ``@``,
  ``/``, ``\\`` or NUL; else 400 naming ``cache_salt``) changes every hash.
* large prompts (issue 15): ``profile_async`` gives the same ``RequestInfo`` without
  holding the event loop: a configured tokenizer (and the chat template) runs in a
  worker thread, the approximation counts in steps of ``OFFLOAD_CHUNK_CHARS``
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
from typing import TYPE_CHECKING, Any

import orjson

from kiloserve.engine.protocol import render_chat_body
from kiloserve.errors import ConfigError, RequestError
from kiloserve.gateway.chat_messages import request_flag
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.model_select import ModelPicker
from kiloserve.policies.base import RequestInfo
from kiloserve.tokens import (
    MAX_TOKEN_ID,
    cache_seed,
    chunk_bounds,
    count_tokens,
    prefix_block_hashes,
    tokenize,
)

if TYPE_CHECKING:  # jinja2 and tokenizers load only when a tokenizer is configured
    from kiloserve.gateway.chat_template import ExactTokenizer

__all__ = [
    "MAX_KEY_CHARS",
    "OutputPredictor",
    "Profiler",
    "approximate_chat_text",
    "bounded_key",
    "jwt_subject",
    "prompt_text",
]

MAX_PIECE_CHARS = 5  # one optional leading space + 4 characters (see kiloserve.tokens)
MAX_KEY_CHARS = 128  # longer user / session / model keys are kept as a digest
OFFLOAD_CHUNK_CHARS = 16 * 1024  # profile_async counts this much text between yields
_DIGEST_PREFIX = "sha256:"
MAX_CACHE_SALT_CHARS = 128  # vLLM's limit, with its forbidden characters below
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def bounded_key(value: str) -> str:
    """``value`` itself when at most ``MAX_KEY_CHARS`` long, else ``sha256:`` and 32 hex
    digits of a digest of all of it: the same for equal values in every process, apart
    for different ones (not truncated: long ids that share a prefix stay distinct)."""
    if len(value) <= MAX_KEY_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return _DIGEST_PREFIX + digest[:32]


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
    checked (``RequestError`` naming ``prompt``). A chat's text is its message contents
    joined by newlines: not what an engine sees (``approximate_chat_text`` is the
    twin's rendering, ``kiloserve.gateway.chat_template`` vLLM's)."""
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


def approximate_chat_text(body: Mapping[str, Any]) -> str:
    """The engine twin's chat prompt for ``body`` (``render_chat_body``), so approximate
    chat ids equal the twin's; a body the twin refuses (the engine answers it) gets the
    contents joined by newlines (``prompt_text``)."""
    try:
        return render_chat_body(dict(body))
    except (RequestError, KeyError):
        return str(prompt_text(body))


def _cache_seed(body: Mapping[str, Any]) -> int:
    """The prefix-hash seed of vLLM's ``cache_salt`` (0 without one), checked as vLLM
    checks it (else 400 naming ``cache_salt``)."""
    salt = body.get("cache_salt")
    if salt is None:
        return 0
    if not isinstance(salt, str) or not salt:
        raise RequestError("'cache_salt' must be a non-empty string", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise RequestError(
            f"'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters and must not "
            "contain '@', '/', '\\' or NUL",
            param="cache_salt",
        )
    return cache_seed(lora_name=None, cache_salt=salt)


def _exact_ids(tok: ExactTokenizer, body: Mapping[str, Any]) -> list[int]:
    """The prompt token ids vLLM computes for ``body`` (a batch of text prompts: each
    one's, one after another; a chat with no template: the twin's text, encoded)."""
    if isinstance(body.get("messages"), list):
        template = tok.template
        text = template.render(body) if template is not None else approximate_chat_text(body)
        return tok.encode(text, request_flag(body, "add_special_tokens", False))
    prompt = body.get("prompt")
    add_special = request_flag(body, "add_special_tokens", True)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return [t for p in prompt if isinstance(p, str) for t in tok.encode(p, add_special)]
    text_or_ids = prompt_text(body)
    if isinstance(text_or_ids, list):
        return text_or_ids
    return tok.encode(text_or_ids, add_special)


def _load_tokenizers(cfg: GatewayConfig) -> dict[str, ExactTokenizer]:
    """Model -> its exact tokenizer, for the models with ``tokenizer`` configured."""
    configured = {name: m for name, m in cfg.models.items() if m.tokenizer is not None}
    if not configured:
        return {}
    try:
        from kiloserve.gateway.chat_template import load_exact_tokenizer
    except ImportError as exc:  # pragma: no cover - the 'tokenizer' extra
        raise ConfigError(
            "models.*.tokenizer needs the 'tokenizer' extra (tokenizers, jinja2)"
        ) from exc
    return {
        name: load_exact_tokenizer(m.tokenizer, m.chat_template, name, m.tokenizer_self_check_every)
        for name, m in configured.items()
        if m.tokenizer is not None
    }


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError("'max_tokens' must be a non-negative integer", param="max_tokens")
    return value


def _approximate_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """What the approximation counts: the twin's chat text, or the prompt (text or ids)."""
    if isinstance(body.get("messages"), list):
        return approximate_chat_text(body)
    return prompt_text(body)


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
        self._models = tuple(cfg.models)
        self._tokenizers = _load_tokenizers(cfg)
        self.model_picker = ModelPicker(cfg.model_from)  # header / JWT claim (S1.1)

    def pick_model(self, body: dict[str, Any], headers: Mapping[str, str]) -> bool:
        """``body["model"]`` from the ``model_from`` sources (``ModelPicker.pick``)."""
        return self.model_picker.pick(body, headers)

    @property
    def has_tokenizers(self) -> bool:
        """True when some model has a real tokenizer (exact mode)."""
        return bool(self._tokenizers)

    def tokenizer_modes(self) -> dict[str, str]:
        """Model -> ``"exact"`` (its tokenizer is configured) or ``"approximate"``, for
        every model with settings (``models.<name>``)."""
        return {m: "exact" if m in self._tokenizers else "approximate" for m in self._models}

    def exact_tokenizer(self, model: str) -> ExactTokenizer | None:
        """The model's exact tokenizer (None: the model counts approximately)."""
        return self._tokenizers.get(model)

    def tokenizer_piece_cache(self) -> dict[str, dict[str, Any]]:
        """Model -> its exact tokenizer's piece cache (``ExactTokenizer.describe``:
        ``state`` on / off, where it cuts, why not), for the models in exact mode."""
        return {m: tok.describe() for m, tok in sorted(self._tokenizers.items())}

    def _hashes(self, ids: list[int], seed: int) -> tuple[int, ...]:
        head = ids[: self._max_prefix_tokens]
        return tuple(prefix_block_hashes(head, self._block_size, seed))

    def _tokens(self, body: Mapping[str, Any], seed: int) -> tuple[int, tuple[int, ...]]:
        """(input token count, prefix block hashes)."""
        tok = self._tokenizers.get(body["model"])
        if tok is not None:
            ids = _exact_ids(tok, body)
            return len(ids), self._hashes(ids, seed)
        prompt = _approximate_prompt(body)
        if isinstance(prompt, list):
            return len(prompt), self._hashes(prompt, seed)
        if len(prompt) <= self._max_prefix_tokens * MAX_PIECE_CHARS:
            ids = tokenize(prompt)  # all of it is hashed: count and ids in one pass
            return len(ids), self._hashes(ids, seed)
        num_tokens = count_tokens(prompt)
        if num_tokens < self._block_size:  # not one full block: no hashes to compute
            return num_tokens, ()
        return num_tokens, self._approx_prefix_hashes(prompt, seed)

    def _approx_prefix_hashes(self, text: str, seed: int) -> tuple[int, ...]:
        max_chars = self._max_prefix_tokens * MAX_PIECE_CHARS
        # past max_chars the last piece may be cut: drop it, the rest is exact
        ids = tokenize(text) if len(text) <= max_chars else tokenize(text[:max_chars])[:-1]
        return self._hashes(ids, seed)

    async def _tokens_async(
        self, body: Mapping[str, Any], seed: int
    ) -> tuple[int, tuple[int, ...]]:
        """``_tokens``, leaving the event loop free while a long prompt is tokenised."""
        tok = self._tokenizers.get(body["model"])
        if tok is not None:  # the template and tokenizers, in a worker thread
            ids = await asyncio.to_thread(_exact_ids, tok, body)
            return len(ids), self._hashes(ids, seed)
        prompt = _approximate_prompt(body)
        if isinstance(prompt, list):
            return len(prompt), self._hashes(prompt, seed)
        num_tokens = await count_tokens_yielding(prompt)
        if num_tokens < self._block_size:
            return num_tokens, ()
        return num_tokens, self._approx_prefix_hashes(prompt, seed)  # bounded: the prefix

    def profile(
        self, request_id: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestInfo:
        max_tokens = _max_tokens(body)
        tokens = self._tokens(body, _cache_seed(body))
        return self._info(request_id, body, headers, max_tokens, tokens)

    async def profile_async(
        self, request_id: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestInfo:
        """``profile`` for large prompts: the same answer, without blocking the loop."""
        max_tokens = _max_tokens(body)
        tokens = await self._tokens_async(body, _cache_seed(body))
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
