"""OpenAI request parsing and response / SSE chunk building for the engine twin.

Requests are parsed from already-decoded JSON into a ``GenerationRequest``; every bad
input raises ``RequestError`` (HTTP 4xx), never anything else.

Chat prompts are rendered with a simple, documented template before tokenisation::

    <|role|>\\n{content}\\n   for every message, then   <|assistant|>\\n

Generated text is deterministic filler: output token ``i`` is the piece
``kiloserve.engine.sequence.output_word(i)`` (a space plus a word of
``kiloserve.tokens.FILLER_WORDS``), so the text re-tokenises (``kiloserve.tokens``) to
exactly the token ids the engine model generated, and a follow-up turn that quotes
the answer hits the prefix cache like it would on vLLM.

The streaming hot path pre-encodes everything except the per-token word: a chunk is
``prefix + word_json + suffix`` where prefix and suffix are bytes built once per
request (``ChunkEncoder``).
"""

from __future__ import annotations

import math
import statistics
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import orjson

from kiloserve.engine.sampling_fields import SamplingFields, fit_pieces, parse_sampling_fields
from kiloserve.engine.sequence import output_word
from kiloserve.errors import ConfigError, RequestError
from kiloserve.tokens import FILLER_WORDS, tokenize

__all__ = [
    "DONE_EVENT",
    "PROBE_HEADER",
    "ChunkEncoder",
    "GenerationRequest",
    "TokenizeFn",
    "chat_template_flags",
    "load_tokenizer",
    "natural_output_tokens",
    "next_stream_chunks",
    "output_text",
    "output_word_json",
    "parse_chat",
    "parse_completion",
    "plan_output",
    "render_chat",
    "render_chat_body",
]

# a gateway health probe (gateway/resilience/prober.py): the twin leaves such requests
# out of its counters and histograms, so probes never show in user-facing stats
PROBE_HEADER = "x-kiloserve-probe"

TokenizeFn = Callable[[str], list[int]]
RequestKind = Literal["completion", "chat"]
DONE_EVENT = b"data: [DONE]\n\n"
MAX_N = 128  # the twin's cap on ``n`` (vLLM has none)
MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as 4-byte words
NATURAL_MEDIAN_TOKENS = 150
NATURAL_SIGMA = 0.8
# output_word(i) cycles with period len(FILLER_WORDS); the unit tests check it.
_NUM_WORDS = len(FILLER_WORDS)
_OUTPUT_WORD_JSON = tuple(orjson.dumps(output_word(i)) for i in range(_NUM_WORDS))
_NORMAL = statistics.NormalDist()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One parsed completion or chat request."""

    kind: RequestKind
    model: str | None
    prompt_token_ids: list[int]
    max_tokens: int | None
    is_stream: bool
    include_usage: bool
    ignore_eos: bool
    fields: SamplingFields = field(default_factory=SamplingFields)  # logprobs, echo, JSON, tools
    n: int = 1  # choices (engine/parallel_sampling.py when > 1)


def load_tokenizer(path: str | None) -> TokenizeFn:
    """``kiloserve.tokens.tokenize``, or a real ``tokenizer.json`` via ``tokenizers``."""
    if path is None:
        return tokenize
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - optional extra
        raise ConfigError("--tokenizer needs the 'tokenizers' package") from exc
    try:
        real = Tokenizer.from_file(path)
    except Exception as exc:
        raise ConfigError(f"--tokenizer: cannot load {path!r}: {exc}") from exc

    def encode(text: str) -> list[int]:
        return list(real.encode(text).ids)

    return encode


def _field_error(param: str, message: str) -> RequestError:
    return RequestError(message, param=param)


def _opt_int(body: dict[str, object], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _field_error(key, f"'{key}' must be an integer")
    if value < minimum:
        raise _field_error(key, f"'{key}' must be at least {minimum}, got {value}")
    return value


def _opt_bool(body: dict[str, object], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _field_error(key, f"'{key}' must be a boolean")
    return value


def _opt_model(body: dict[str, object]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _field_error("model", "'model' must be a string")
    return model


def _include_usage(body: dict[str, object]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _field_error("stream_options", "'stream_options' must be an object")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise _field_error("stream_options", "'include_usage' must be a boolean")
    return value


def _num_choices(body: dict[str, object]) -> int:
    n = _opt_int(body, "n", 1)
    if n is not None and n > MAX_N:
        raise _field_error("n", f"the engine twin serves at most n={MAX_N}")
    return n or 1


def _as_object(body: object) -> dict[str, object]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    )


def _prompt_ids(prompt: object, tokenize: TokenizeFn) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_list(prompt):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and _is_token_list(prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _field_error("prompt", "the engine twin accepts one prompt per request")
    raise _field_error(
        "prompt", f"'prompt' must be a non-empty string or list of token ids (0..{MAX_TOKEN_ID})"
    )


def _common(body: dict[str, object], kind: RequestKind, ids: list[int]) -> GenerationRequest:
    if not ids:
        raise _field_error("prompt", "The prompt cannot be empty")
    max_tokens = _opt_int(body, "max_tokens", 1)
    if kind == "chat":
        max_completion = _opt_int(body, "max_completion_tokens", 1)
        max_tokens = max_completion if max_completion is not None else max_tokens
    is_stream = _opt_bool(body, "stream")
    include_usage = _include_usage(body)
    if body.get("stream_options") is not None and not is_stream:
        raise _field_error("stream_options", "stream_options is only allowed with stream=true")
    return GenerationRequest(
        kind=kind,
        model=_opt_model(body),
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        is_stream=is_stream,
        include_usage=include_usage,
        ignore_eos=_opt_bool(body, "ignore_eos"),
        fields=parse_sampling_fields(body, kind),
        n=_num_choices(body),
    )


def parse_completion(raw: object, tokenize: TokenizeFn) -> GenerationRequest:
    """Parse a ``/v1/completions`` body (``prompt``: string, token ids, or a list of one)."""
    body = _as_object(raw)
    if "prompt" not in body:
        raise _field_error("prompt", "missing required field 'prompt'")
    return _common(body, "completion", _prompt_ids(body["prompt"], tokenize))


def _message_text(message: object, index: int) -> tuple[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _field_error(param, f"{param} must be an object")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise _field_error(param, f"{param}.role must be a string")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(parts) == len(content) and all(isinstance(t, str) for t in parts):
            return role, "".join(str(t) for t in parts)
    raise _field_error(param, f"{param}.content must be a string or a list of text parts")


def render_chat(
    messages: object, *, add_generation_prompt: bool = True, continue_final_message: bool = False
) -> str:
    """The twin's chat template applied to ``messages``.

    As vLLM's chat parameters: ``add_generation_prompt`` (default on) ends with the
    assistant header; ``continue_final_message`` renders the last message (which must
    be the assistant's) open, without its end, so the model continues it. Both on is an
    error, as in vLLM.
    """
    if not isinstance(messages, list) or not messages:
        raise _field_error("messages", "'messages' must be a non-empty list")
    if add_generation_prompt and continue_final_message:
        raise _field_error(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )
    pairs = [_message_text(m, i) for i, m in enumerate(messages)]
    if continue_final_message:
        if pairs[-1][0] != "assistant":
            raise _field_error(
                "continue_final_message", "continue_final_message needs a final assistant message"
            )
        head = "".join(f"<|{role}|>\n{content}\n" for role, content in pairs[:-1])
        return head + f"<|assistant|>\n{pairs[-1][1]}"
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in pairs)
    return text + "<|assistant|>\n" if add_generation_prompt else text


def chat_template_flags(body: dict[str, object]) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` of a chat body (400 if not bools)."""
    flags = []
    for key, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(key, default)
        if not isinstance(value, bool):
            raise _field_error(key, f"'{key}' must be a boolean")
        flags.append(value)
    return flags[0], flags[1]


def render_chat_body(body: dict[str, object]) -> str:
    """``render_chat`` of a chat body's ``messages`` with its template flags."""
    add, cont = chat_template_flags(body)
    return render_chat(body["messages"], add_generation_prompt=add, continue_final_message=cont)


def parse_chat(raw: object, tokenize: TokenizeFn) -> GenerationRequest:
    """Parse a ``/v1/chat/completions`` body."""
    body = _as_object(raw)
    if "messages" not in body:
        raise _field_error("messages", "missing required field 'messages'")
    return _common(body, "chat", tokenize(render_chat_body(body)))


def natural_output_tokens(prompt_token_ids: list[int]) -> int:
    """Deterministic 'natural' answer length: lognormal (median 150) from a prompt hash."""
    data = b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in prompt_token_ids)
    u = (zlib.crc32(data) + 0.5) / 2**32
    return max(1, round(NATURAL_MEDIAN_TOKENS * math.exp(NATURAL_SIGMA * _NORMAL.inv_cdf(u))))


def plan_output(request: GenerationRequest, max_model_len: int) -> tuple[int, str]:
    """``(num_output_tokens, finish_reason)``; raises 400 when the context does not fit.

    ``max_tokens`` given: exactly that many tokens, finish ``"length"``. Not given: the
    natural length (finish ``"stop"``) capped by the context, or with ``ignore_eos`` the
    whole remaining context (finish ``"length"``).
    """
    num_prompt = len(request.prompt_token_ids)
    room = max_model_len - num_prompt
    wanted = request.max_tokens if request.max_tokens is not None else 1
    if request.fields.pieces and room >= wanted:
        return fit_pieces(request.fields, request.max_tokens, room)
    if room < wanted:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + wanted} tokens ({num_prompt} in the messages, "
            f"{wanted} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="max_tokens" if request.max_tokens is not None else "messages",
        )
    if request.max_tokens is not None:
        return request.max_tokens, "length"
    if request.ignore_eos:
        return room, "length"
    natural = natural_output_tokens(request.prompt_token_ids)
    return (natural, "stop") if natural < room else (room, "length")


def output_word_json(index: int) -> bytes:
    """JSON string of output token ``index`` (pre-encoded ``output_word(index)``)."""
    return _OUTPUT_WORD_JSON[index % _NUM_WORDS]


def output_text(num_tokens: int) -> str:
    """The full generated text of ``num_tokens`` output tokens."""
    return "".join(output_word(i) for i in range(num_tokens))


def _usage(num_prompt: int, num_completion: int, num_cached: int | None) -> dict[str, object]:
    """vLLM's ``usage``; with ``num_cached`` (``--enable-prompt-tokens-details``) also
    ``prompt_tokens_details.cached_tokens``: the prompt tokens served from the prefix
    cache when the request was first scheduled."""
    usage: dict[str, object] = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }
    if num_cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return usage


class ChunkEncoder:
    """Builds one request's response bytes; SSE chunks from pre-encoded templates."""

    def __init__(self, kind: RequestKind, request_id: str, model: str, created: int) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = created
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        head = orjson.dumps({"id": request_id, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1]
        if kind == "completion":
            self._prefix = self._head + b',"choices":[{"index":0,"text":'
            tail = b',"logprobs":null,"finish_reason":%s,"stop_reason":null}]}\n\n'
        else:
            self._prefix = self._head + b',"choices":[{"index":0,"delta":{"content":'
            tail = b'},"logprobs":null,"finish_reason":%s}]}\n\n'
        self._suffix = tail % b"null"
        self._tail = tail

    def role_chunk(self) -> bytes:
        """Chat only: the first chunk, carrying ``delta.role``."""
        body = b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        return self._head + body + b'"logprobs":null,"finish_reason":null}]}\n\n'

    def token_chunks(self, start: int, count: int, finish: str | None) -> bytes:
        """SSE chunks for output tokens ``start .. start+count-1``; the last one may finish."""
        prefix, suffix = self._prefix, self._suffix
        num_plain = count - 1 if finish is not None else count
        parts = [prefix + output_word_json(i) + suffix for i in range(start, start + num_plain)]
        if finish is not None:
            last_suffix = self._tail % orjson.dumps(finish)
            parts.append(prefix + output_word_json(start + count - 1) + last_suffix)
        return b"".join(parts)

    def finish_chunk(self, finish: str) -> bytes:
        """A content-less chunk carrying only ``finish_reason`` (used when no token is left)."""
        return self._prefix + b'""' + self._tail % orjson.dumps(finish)

    def usage_chunk(
        self, num_prompt: int, num_completion: int, num_cached: int | None = None
    ) -> bytes:
        """Final chunk for ``stream_options.include_usage``: empty choices plus usage
        (``num_cached``: also ``prompt_tokens_details``, as ``_usage``)."""
        usage = orjson.dumps(_usage(num_prompt, num_completion, num_cached))
        return self._head + b',"choices":[],"usage":' + usage + b"}\n\n"

    def full_response(
        self, num_prompt: int, num_completion: int, finish: str, num_cached: int | None = None
    ) -> bytes:
        """The non-streaming JSON response body (``num_cached``: as ``usage_chunk``)."""
        text = output_text(num_completion)
        if self.kind == "completion":
            choice: dict[str, object] = {"index": 0, "text": text, "logprobs": None}
            choice.update(finish_reason=finish, stop_reason=None)
            obj = "text_completion"
        else:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        body = {"id": self.request_id, "object": obj, "created": self.created}
        usage = _usage(num_prompt, num_completion, num_cached)
        body.update(model=self.model, choices=[choice], usage=usage)
        return orjson.dumps(body)


def next_stream_chunks(
    encoder: ChunkEncoder,
    num_sent: int,
    num_ready: int,
    finish_reason: str | None,
    stall_after_tokens: int | None,
) -> tuple[bytes, int, bool]:
    """``(bytes to write, new num_sent, is_stalled)`` for the tokens ready now.

    With ``stall_after_tokens`` reached the stream stalls: tokens up to the stall
    point are sent, no finish chunk, and the caller sends nothing more.
    """
    if stall_after_tokens is not None and num_ready >= stall_after_tokens:
        num_end = max(num_sent, stall_after_tokens)
        return encoder.token_chunks(num_sent, num_end - num_sent, None), num_end, True
    if finish_reason is None:
        return encoder.token_chunks(num_sent, num_ready - num_sent, None), num_ready, False
    if num_ready == num_sent:
        return encoder.finish_chunk(finish_reason), num_ready, False
    return encoder.token_chunks(num_sent, num_ready - num_sent, finish_reason), num_ready, False
