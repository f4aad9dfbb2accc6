"""Chat request fields as vLLM reads them before its chat template runs (no jinja2 here).

* ``messages`` are normalised as vLLM's ``parse_chat_messages`` does: a content of
  text parts is joined by ``"\\n"`` for a "string" template and kept as
  ``{"type": "text", "text"}`` parts (plus the part's unknown keys) for an "openai" one;
  media parts are left out (their placeholders are model-specific) or kept as
  ``{"type": "image"|"audio"|"video"}``; only ``role``, ``content`` and, by role,
  ``tool_calls`` (arguments parsed to objects), ``reasoning``, ``tool_call_id``,
  ``name``, ``task`` and a developer's ``tools`` reach the template; a system text part
  that starts with Claude Code's per-request billing header loses that line.
* a template that never names the ``developer`` role gets developer messages as system
  ones, all system messages merged (``"\\n\\n"``) into the first.
* ``tools`` as ``ChatCompletionToolsParam.model_dump()`` gives them; the template's
  keyword arguments are ``chat_template_kwargs`` under the request's
  ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
  ``reasoning_effort`` (which also sets ``enable_thinking`` unless given), over the
  tools, values ``None`` and ``"auto"`` dropped (vLLM's ``merge_kwargs``).
* booleans are read as pydantic's lax mode does (``"yes"``, ``1``, ...).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Literal

from kiloserve.errors import RequestError

__all__ = [
    "ContentFormat",
    "conversation",
    "developer_as_system",
    "request_flag",
    "template_kwargs",
]

ContentFormat = Literal["string", "openai"]
_UNSET = (None, "auto")  # vLLM's merge_kwargs drops these values
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})  # pydantic's lax bool
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text"}
_TEXT_FIELDS |= {"refusal": "refusal", "thinking": "thinking"}
_MEDIA = {"image_url": "image", "input_image": "image", "image_pil": "image"}
_MEDIA |= {"image_embeds": "image", "audio_url": "audio", "input_audio": "audio"}
_MEDIA |= {"audio_embeds": "audio", "video_url": "video", "video_embeds": "video"}
_PART_FIELDS = frozenset(
    {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil"}
    | {"image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text"}
    | {"thinking", "type", "uuid", "video_embeds", "video_url"}
)  # vLLM's _KNOWN_CONTENT_PART_FIELDS: other keys of a part reach an "openai" template
_BILLING_HEADER = "x-anthropic-billing-header"


def request_flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean body field as pydantic reads it (true/false, 0/1, "yes"/"no", ...);
    absent or null is ``default``; anything else is a 400 naming ``key``."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.lower() in _TRUE_WORDS
    raise RequestError(f"'{key}' must be a boolean", param=key)


def template_kwargs(body: Mapping[str, Any], add: bool, cont: bool) -> dict[str, Any]:
    """What vLLM passes to ``apply_chat_template``: ``chat_template_kwargs`` under the
    request's own fields, over the request's tools (values None / "auto" dropped)."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    extra: dict[str, Any] = {"add_generation_prompt": add, "continue_final_message": cont}
    extra |= {"documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    merged = user | {k: v for k, v in extra.items() if v not in _UNSET}
    tools = _tools(body.get("tools"))
    defaults = {} if tools is None else {"tools": tools}
    return defaults | {k: v for k, v in merged.items() if v not in _UNSET}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("each tool needs a function with a name", param="tools")
        if tool.get("type", "function") != "function":
            raise RequestError("tools must be of type 'function'", param="tools")
        defer = tool.get("defer_loading")
        dumped = {"name": fn["name"], "description": fn.get("description")}
        dumped["parameters"] = fn.get("parameters")
        if fn.get("strict") is not None:
            dumped["strict"] = fn["strict"]
        if (fn_defer := fn.get("defer_loading", defer)) is not None:
            dumped["defer_loading"] = fn_defer
        item: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
        if defer is not None:
            item["defer_loading"] = defer
        out.append(item)
    return out


def conversation(messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages a template of format ``fmt`` sees (400 naming ``messages`` when
    they are not a non-empty list of objects with a string role)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = [_message(m, i, fmt) for i, m in enumerate(messages)]
    for message in out:
        _parse_tool_calls(message)
    return out


def _message(message: Any, index: int, fmt: ContentFormat) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"{param} must be an object with a string 'role'", param="messages")
    role: str = message["role"]
    content = message.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise RequestError(f"{param}.content must be a string or a list", param="messages")
    if role == "system":
        parts = _strip_billing_header(parts)
    items = [p for p in (_part(p, fmt, param) for p in parts) if p is not None]
    out: dict[str, Any] = {"role": role}
    out["content"] = items if fmt == "openai" else "\n".join(str(t) for t in items)
    _copy_fields(message, out)
    return out


def _copy_fields(message: dict[str, Any], out: dict[str, Any]) -> None:
    role = out["role"]
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = copy.deepcopy(message["tool_calls"])  # arguments get parsed
        if (reasoning := message.get("reasoning")) is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        content = out["content"]
        if isinstance(content, list) and all(p.get("type") == "text" for p in content):
            out["content"] = "\n".join(str(p.get("text", "")) for p in content)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")


def _part(part: Any, fmt: ContentFormat, param: str) -> Any:
    """One content part: its text (string format) or a dict (openai format); None to skip."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if fmt == "openai" else part
    if not isinstance(part, dict):
        raise RequestError(f"{param}.content parts must be objects", param="messages")
    kind = part.get("type")
    extra = {k: v for k, v in part.items() if k not in _PART_FIELDS}
    if kind in _TEXT_FIELDS:
        text = part.get(_TEXT_FIELDS[kind])
        if text is None:
            return None
        return {"type": "text", "text": text, **extra} if fmt == "openai" else text
    if kind == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if fmt == "openai" else name
    modality = _MEDIA.get(kind) if isinstance(kind, str) else None
    if modality is None:
        modality = next((m for k, m in _MEDIA.items() if kind is None and k in part), None)
    if modality is None:
        raise RequestError(f"Unsupported chat content part type: {kind!r}", param="messages")
    # multimodal placeholders are model-specific: left out (the ids are approximate)
    return {"type": modality, **extra} if fmt == "openai" else None


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops the first line of a system text part that starts with Claude Code's
    per-request billing header (it would break the prefix cache)."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_calls(message: dict[str, Any]) -> None:
    """Assistant tool-call arguments as objects (vLLM's _postprocess_messages)."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for call in calls:
        if not isinstance(call, dict):
            raise RequestError("assistant tool_calls entries must be objects", param="tool_calls")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError("assistant tool_calls must be functions", param="tool_calls")
        args = fn.get("arguments")
        if isinstance(args, str) and args:  # a malformed string becomes {} (vLLM too)
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        fn["arguments"] = args if isinstance(args, dict) else {}


def developer_as_system(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """For a template (``source``) that never names the developer role: developer
    messages as system ones, all system messages merged into the first (vLLM's)."""
    if '"developer"' in source or "'developer'" in source:
        return messages
    if not any(m["role"] == "developer" for m in messages):
        return messages
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = [_system_text(converted[i].get("content", "")) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def _system_text(content: Any) -> str:
    if isinstance(content, list):
        texts = [p["text"] if isinstance(p, dict) and "text" in p else p for p in content]
        return "\n".join(t for t in texts if isinstance(t, str))
    return str(content) if content else ""
