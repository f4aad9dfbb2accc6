"""Request parsing and response shapes of the twin's agent-era APIs (issue 18).

The shapes follow vLLM's servers (``vllm/entrypoints/openai/serving_responses.py``,
``serving_embedding.py``, ``vllm/entrypoints/anthropic/serving_messages.py``), which
follow OpenAI's and Anthropic's:

* ``/v1/responses``: ``instructions`` + ``input`` (a string, or a list of message
  items whose ``content`` is a string or ``input_text`` / ``output_text`` parts; other
  items such as ``function_call_output`` count as user text) become chat messages,
  rendered with the twin's chat template (``protocol.render_chat``).
* ``/v1/messages``: Anthropic's ``system`` (string or text blocks) + ``messages``
  (content a string or blocks: ``text``, ``tool_result``; other blocks carry no text
  here) become chat messages the same way; ``max_tokens`` is required.
* ``/v1/embeddings``: ``input`` a string, a list of strings, a list of token ids or a
  list of lists of ids; the vectors are deterministic pseudo-embeddings of the token ids
  (unit length; ``dimensions`` keeps the first N and renormalises, as a Matryoshka
  model does), ``encoding_format`` ``float`` or ``base64`` (little-endian float32).

Every bad input raises ``RequestError`` (400) naming the field.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import zlib
from collections.abc import Mapping
from typing import Any

from kiloserve.errors import RequestError
from kiloserve.tokens import MAX_TOKEN_ID

__all__ = [
    "anthropic_chat_messages",
    "embedding_inputs",
    "encode_embedding",
    "pseudo_embedding",
    "responses_chat_messages",
    "truncate_embedding",
]

Message = dict[str, Any]


def _parts_text(content: Any, param: str) -> str:
    """A message's text: a string, or the ``text`` of its parts (blocks); a
    ``tool_result`` block's own content counts as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{param}' must be a string or a list of parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise RequestError(f"'{param}' parts must be objects", param=param)
        if part.get("type") == "tool_result":
            texts.append(_parts_text(part.get("content"), param))
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "".join(texts)


def responses_chat_messages(body: Mapping[str, Any]) -> list[Message]:
    """The chat messages of a Responses API body (``instructions`` first)."""
    messages: list[Message] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a non-empty string or list of items", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object", param="input")
        role = item.get("role")
        content = item.get("content", item.get("output"))
        text = _parts_text(content, "input") if not isinstance(content, dict) else ""
        messages.append({"role": role if isinstance(role, str) else "user", "content": text})
    return messages


def anthropic_chat_messages(body: Mapping[str, Any]) -> list[Message]:
    """The chat messages of an Anthropic Messages body (``system`` first)."""
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _parts_text(system, "system")})
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, item in enumerate(items):
        role = item.get("role") if isinstance(item, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(
                f"messages[{i}].role must be 'user' or 'assistant'", param="messages"
            )
        messages.append({"role": role, "content": _parts_text(item.get("content"), "messages")})
    return messages


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)
    )


def embedding_inputs(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The inputs of an embeddings body, each a text or a list of token ids."""
    value = body.get("input")
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and _is_ids(value):
        return [list(value)]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) and v for v in value):
            return list(value)
        if all(_is_ids(v) for v in value):
            return [list(v) for v in value]
    raise RequestError(
        "'input' must be a non-empty string, list of strings, list of token ids or list "
        "of lists of token ids",
        param="input",
    )


def pseudo_embedding(token_ids: list[int], num_dims: int) -> list[float]:
    """A unit vector of ``num_dims`` floats determined by ``token_ids`` alone."""
    data = b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in token_ids)
    rng = random.Random(zlib.crc32(data))
    vec = [rng.gauss(0.0, 1.0) for _ in range(num_dims)]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


def truncate_embedding(vec: list[float], num_dims: int) -> list[float]:
    """The first ``num_dims`` values, renormalised to unit length (Matryoshka)."""
    head = vec[:num_dims]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encode_embedding(vec: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32 bytes, base64 (OpenAI's)."""
    if encoding_format == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
