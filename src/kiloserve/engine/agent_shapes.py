"""Response bodies and SSE events of the twin's Responses and Anthropic Messages APIs.

Responses API stream (OpenAI's event names, as vLLM's ``serving_responses`` sends
them), each ``event: <type>`` + ``data: {"type": <type>, "sequence_number": n, ...}``:
``response.created`` and ``response.in_progress`` when the request is accepted, then
with the first token ``response.output_item.added`` and ``response.content_part.added``,
one ``response.output_text.delta`` per token, and at the end
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed``. No ``[DONE]``.

Anthropic Messages stream (as vLLM's ``/v1/messages``, converted from its chat stream,
so everything starts with the first token): ``message_start``,
``content_block_start``, one ``content_block_delta`` (``text_delta``) per token,
``content_block_stop``, ``message_delta`` (stop reason, output tokens),
``message_stop``.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

__all__ = ["MessagesEncoder", "ResponsesEncoder", "responses_usage", "sse_event"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """One ``event:`` + ``data:`` server-sent event."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesEncoder:
    """One Responses API answer: the response object and its stream events."""

    def __init__(self, response_id: str, model: str, created_s: int, fields: dict[str, Any]):
        self.response_id = response_id
        self.item_id = "msg_" + uuid.uuid4().hex
        self._model = model
        self._created_s = created_s
        self._fields = fields  # echoed request fields (instructions, max_output_tokens, ...)
        self._seq = 0

    def response(
        self, status: str, text: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The response object; ``text`` None: no output yet (in progress)."""
        output = [] if text is None else [self.item("completed", text)]
        return {
            "id": self.response_id, "object": "response", "created_at": self._created_s,
            "model": self._model, "status": status, "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": usage, **self._fields,
        }  # fmt: skip

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {
            "id": self.item_id, "type": "message", "role": "assistant", "status": status,
            "content": content,
        }  # fmt: skip

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    def event(self, name: str, **payload: Any) -> bytes:
        data = {"type": name, "sequence_number": self._seq, **payload}
        self._seq += 1
        return sse_event(name, data)

    def start_events(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        response = self.response("in_progress", None, None)
        return self.event("response.created", response=response) + self.event(
            "response.in_progress", response=response
        )

    def first_events(self) -> bytes:
        """The output item and its text part, opened with the first token."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return self.event(
            "response.output_item.added", output_index=0, item=self.item("in_progress", None)
        ) + self.event("response.content_part.added", **where, part=self.part(""))

    def delta(self, text: str) -> bytes:
        return self.event(
            "response.output_text.delta", item_id=self.item_id, output_index=0,
            content_index=0, delta=text, logprobs=[],
        )  # fmt: skip

    def end_events(self, text: str, status: str, usage: dict[str, Any]) -> bytes:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join((
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=self.part(text)),
            self.event(
                "response.output_item.done", output_index=0, item=self.item("completed", text)
            ),
            self.event("response.completed", response=self.response(status, text, usage)),
        ))  # fmt: skip


def responses_usage(num_prompt: int, num_output: int, num_cached: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt + num_output,
    }  # fmt: skip


class MessagesEncoder:
    """One Anthropic Messages answer: the message object and its stream events."""

    def __init__(self, model: str) -> None:
        self.message_id = "msg_" + uuid.uuid4().hex
        self._model = model

    def message(
        self, text: str, finish: str | None, num_prompt: int, num_output: int
    ) -> dict[str, Any]:
        content = [{"type": "text", "text": text}] if finish is not None else []
        return {
            "id": self.message_id, "type": "message", "role": "assistant",
            "model": self._model, "content": content,
            "stop_reason": _STOP_REASONS.get(finish or ""), "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": num_output},
        }  # fmt: skip

    def first_events(self, num_prompt: int) -> bytes:
        start = {"type": "message_start", "message": self.message("", None, num_prompt, 0)}
        block = {
            "type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""},
        }  # fmt: skip
        return sse_event("message_start", start) + sse_event("content_block_start", block)

    @staticmethod
    def delta(text: str) -> bytes:
        payload = {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text},
        }  # fmt: skip
        return sse_event("content_block_delta", payload)

    @staticmethod
    def end_events(num_output: int, finish: str) -> bytes:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": _STOP_REASONS.get(finish), "stop_sequence": None},
            "usage": {"output_tokens": num_output},
        }
        return (
            sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + sse_event("message_delta", delta)
            + sse_event("message_stop", {"type": "message_stop"})
        )
