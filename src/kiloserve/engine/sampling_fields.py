"""Request fields that change what the twin answers, honoured or refused as vLLM 0.32 does.

* ``logprobs`` (completions: an int, the number of alternatives; chat: a bool, with
  ``top_logprobs``): per output token a deterministic log probability (the sampled
  token is always the most likely one) and alternatives drawn from the filler words;
  at most ``MAX_LOGPROBS`` (vLLM's default ``--max-logprobs``), else 400.
* ``echo``: the prompt text comes first in the output (completions: the prompt; chat:
  the last message, when it is the assistant's, as vLLM). A prompt of token ids is
  refused (the twin cannot detokenize).
* ``response_format``: ``text``; ``json_object`` (a small JSON object); ``json_schema``
  (a value that matches a simple schema: object / array / string / number / integer /
  boolean / null / enum / const; anything else is a 400 naming the keyword).
* ``tools`` + ``tool_choice`` (chat): the twin acts as vLLM started with
  ``--tool-call-parser`` and without ``--enable-auto-tool-choice``: ``"required"`` calls
  the first tool, a named function calls that one (arguments: a value of its
  ``parameters`` schema), ``"none"`` answers in text, and ``"auto"`` (the default when
  ``tools`` are given) is vLLM's 400.

Structured output (JSON text, tool arguments) is split into pieces, one per output
token; the request finishes after the last piece (``stop``) unless ``max_tokens`` or
the context cuts it first (``length``), like vLLM's guided decoding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from kiloserve.errors import RequestError

__all__ = [
    "MAX_LOGPROBS",
    "SamplingFields",
    "fit_pieces",
    "parse_sampling_fields",
    "value_for_schema",
]

MAX_LOGPROBS = 20
MAX_ITEMS = 16  # a schema's minItems beyond this gets one item
AUTO_TOOLS_MESSAGE = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
_PIECE = re.compile(r"\s*[A-Za-z0-9_.\-]+|\s*\S")
_SIMPLE_KEYS = frozenset(
    {"type", "properties", "required", "items", "enum", "const", "title", "description",
     "additionalProperties", "default", "minItems", "maxItems", "minimum", "maximum",
     "minLength", "maxLength", "$schema"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """What a request asks beyond plain text (all off: ``SamplingFields()``)."""

    num_logprobs: int | None = None  # None: no logprobs; chat: top_logprobs
    echo_text: str = ""  # text put before the generated text
    pieces: tuple[str, ...] = ()  # structured output, one piece per token (empty: filler)
    tool_name: str | None = None  # the output is this function's call
    is_tool_required: bool = False  # tool_choice "required": finish "tool_calls"

    @property
    def is_plain(self) -> bool:
        return self.num_logprobs is None and not self.echo_text and not self.pieces


def _error(param: str, message: str) -> RequestError:
    return RequestError(message, param=param)


def _int_in(body: dict[str, object], key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _error(key, f"'{key}' must be an integer from {lo} to {hi}")
    return value


def _logprobs(body: dict[str, object], kind: str) -> int | None:
    if kind == "completion":
        return _int_in(body, "logprobs", 0, MAX_LOGPROBS)
    value = body.get("logprobs")
    if value is not None and not isinstance(value, bool):
        raise _error("logprobs", "'logprobs' must be a boolean")
    top = _int_in(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and top > 0 and not value:
        raise _error("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true")
    return (top or 0) if value else None


def _echo_text(body: dict[str, object], kind: str) -> str:
    echo = body.get("echo", False)
    if echo is None or echo is False:
        return ""
    if not isinstance(echo, bool):
        raise _error("echo", "'echo' must be a boolean")
    if kind == "chat":
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        is_assistant = isinstance(last, dict) and last.get("role") == "assistant"
        content = last.get("content") if isinstance(last, dict) else None
        return content if is_assistant and isinstance(content, str) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _error("echo", "the engine twin echoes only text prompts (not token ids)")
    return prompt


def value_for_schema(schema: object, path: str = "schema", param: str = "response_format") -> Any:
    """A JSON value that matches a simple JSON schema; 400 for what it cannot honour."""
    if not isinstance(schema, dict):
        raise _error(param, f"{path} must be a JSON object")
    unknown = sorted(set(schema) - _SIMPLE_KEYS)
    if unknown:
        raise _error(param, f"the engine twin cannot honour {path}.{unknown[0]}")
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type", "object")
    if kind == "object":
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise _error(param, f"{path}.properties must be an object")
        return {k: value_for_schema(v, f"{path}.properties.{k}", param) for k, v in props.items()}
    if kind == "array":
        low = schema.get("minItems", 1)
        num = low if isinstance(low, int) and 1 <= low <= MAX_ITEMS else 1
        items = schema.get("items", {"type": "string"})
        return [value_for_schema(items, path + ".items", param)] * num
    simple = {"string": "text", "integer": 1, "number": 1.5, "boolean": True, "null": None}
    if isinstance(kind, str) and kind in simple:
        return simple[kind]
    raise _error(param, f"the engine twin cannot honour {path}.type={kind!r}")


def _response_format(body: dict[str, object]) -> str | None:
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return orjson.dumps({"text": "the answer"}).decode()
    if kind == "json_schema" and isinstance(spec, dict):
        inner = spec.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        return orjson.dumps(value_for_schema(schema if schema is not None else {})).decode()
    raise _error(
        "response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'"
    )


def _tool_named(tools: list[Any], name: str) -> dict[str, Any]:
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            return function
    raise _error("tool_choice", f"Tool '{name}' has not been passed in `tools`.")


def _tool_call(body: dict[str, object]) -> tuple[dict[str, Any], bool] | None:
    """``(function, is_required)`` of the tool to call, None for text; 400 as vLLM."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        raise _error("tools", "`tools` must not be an empty array.")
    if choice is None and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return None
    if not isinstance(tools, list):
        raise _error("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if choice == "auto":
        raise _error("tool_choice", AUTO_TOOLS_MESSAGE)
    if choice == "required":
        return _tool_named(tools, _first_tool_name(tools)), True
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise _error(
            "tool_choice",
            'Only named tools, "none", "auto" or "required" are supported. Correct usage: '
            '`{"type": "function", "function": {"name": "my_function"}}`',
        )
    return _tool_named(tools, name), False


def _first_tool_name(tools: list[Any]) -> str:
    first = tools[0] if tools else None
    function = first.get("function") if isinstance(first, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _error("tools", "each tool needs 'function.name'")
    return name


def _split(text: str) -> tuple[str, ...]:
    return tuple(_PIECE.findall(text))


def parse_sampling_fields(body: object, kind: str) -> SamplingFields:
    """The fields of a completion (``kind`` ``"completion"``) or chat request body."""
    if not isinstance(body, dict):
        return SamplingFields()
    num_logprobs = _logprobs(body, kind)
    echo_text = _echo_text(body, kind)
    call = _tool_call(body) if kind == "chat" else None
    if call is not None:
        function, is_required = call
        schema = function.get("parameters") or {"type": "object"}
        args = value_for_schema(schema, "parameters", "tools")
        pieces = _split(orjson.dumps(args).decode())
        return SamplingFields(num_logprobs, echo_text, pieces, function["name"], is_required)
    structured = _response_format(body)
    pieces = _split(structured) if structured is not None else ()
    return SamplingFields(num_logprobs, echo_text, pieces)


def fit_pieces(fields: SamplingFields, max_tokens: int | None, room: int) -> tuple[int, str]:
    """``(num_output_tokens, finish_reason)`` for structured output: every piece, or
    fewer when ``max_tokens`` or the context (``room``) cuts it (``length``)."""
    limit = min(room, max_tokens) if max_tokens is not None else room
    num = len(fields.pieces)
    return (num, "stop") if num <= limit else (limit, "length")
