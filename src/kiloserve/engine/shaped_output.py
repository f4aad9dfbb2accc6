"""Responses for requests with ``engine.sampling_fields`` (logprobs, echo, JSON, tools).

``ShapedChunkEncoder`` is a ``ChunkEncoder`` whose chunks are built per token as JSON
(the plain encoder's pre-encoded hot path stays for plain requests). Shapes are vLLM's:

* completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``
  (``top_logprobs``: one ``{token: logprob}`` per token, ``max(n, 1)`` entries);
* chat ``logprobs``: ``{content: [{token, logprob, bytes, top_logprobs}]}``;
* tool calls: ``message.tool_calls`` (``id``, ``type``, ``function.name``,
  ``function.arguments`` as JSON text) and ``content: ""``; streamed, the first delta
  carries ``id``, ``type`` and ``name``, later ones argument pieces. ``finish_reason``
  ``tool_calls`` for ``tool_choice: "required"``, ``stop`` for a named function.

Log probabilities are deterministic: token ``i`` has ``-0.05 * (1 + i % 7)``; the
alternatives are the next filler words, each ``1.5`` lower than the one before.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from kiloserve.engine.protocol import ChunkEncoder, RequestKind
from kiloserve.engine.sampling_fields import SamplingFields
from kiloserve.engine.sequence import output_word

__all__ = ["ShapedChunkEncoder"]


def _logprob(index: int) -> float:
    return round(-0.05 * (1 + index % 7), 4)


def _alternatives(index: int, token: str, num: int) -> list[tuple[str, float]]:
    out = [(token, _logprob(index))]
    step = 1
    while len(out) < num:
        word = output_word(index + step)
        if all(word != w for w, _ in out):
            out.append((word, round(out[-1][1] - 1.5, 4)))
        step += 1
    return out


class ShapedChunkEncoder(ChunkEncoder):
    """A ``ChunkEncoder`` that honours ``fields`` (see the module docstring)."""

    def __init__(
        self,
        kind: RequestKind,
        request_id: str,
        model: str,
        created: int,
        fields: SamplingFields,
        index: int = 0,
    ) -> None:
        super().__init__(kind, request_id, model, created)
        self.fields = fields
        self.index = index  # the choice (``n`` > 1: engine/parallel_sampling.py)
        self._call_id = "chatcmpl-tool-" + uuid.uuid4().hex

    def token_text(self, index: int) -> str:
        """The text of output token ``index`` (without the echo)."""
        pieces = self.fields.pieces
        return pieces[index] if index < len(pieces) else output_word(index)

    def _finish(self, finish: str | None) -> str | None:
        if finish == "stop" and self.fields.tool_name is not None and self.fields.is_tool_required:
            return "tool_calls"
        return finish

    def _completion_logprobs(self, start: int, count: int, offset: int) -> dict[str, Any]:
        num = self.fields.num_logprobs or 0
        tokens, offsets = [], []
        for i in range(start, start + count):
            tokens.append(self.token_text(i))
            offsets.append(offset)
            offset += len(tokens[-1])
        top = [dict(_alternatives(i, t, max(num, 1))) for i, t in enumerate(tokens, start)]
        lps = [_logprob(i) for i in range(start, start + count)]
        out = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top}
        return {**out, "text_offset": offsets}

    def _chat_logprobs(self, start: int, count: int) -> dict[str, Any]:
        num = self.fields.num_logprobs or 0
        content = []
        for i in range(start, start + count):
            token = self.token_text(i)
            top = [
                {"token": w, "logprob": lp, "bytes": list(w.encode())}
                for w, lp in _alternatives(i, token, num)[:num]
            ]
            entry = {"token": token, "logprob": _logprob(i), "bytes": list(token.encode())}
            content.append({**entry, "top_logprobs": top})
        return {"content": content}

    def _logprobs(self, start: int, count: int, offset: int) -> dict[str, Any] | None:
        if self.fields.num_logprobs is None:
            return None
        if self.kind == "completion":
            return self._completion_logprobs(start, count, offset)
        return self._chat_logprobs(start, count)

    def _text_before(self, index: int) -> int:
        """Characters of output before token ``index`` (echo included): text offsets."""
        return len(self.fields.echo_text) + sum(len(self.token_text(i)) for i in range(index))

    def _delta(self, index: int, text: str) -> dict[str, Any]:
        if self.fields.tool_name is None:
            return {"content": text}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if index == 0:
            call = {"id": self._call_id, "type": "function", "index": 0}
            call["function"] = {"name": self.fields.tool_name, "arguments": text}
        return {"tool_calls": [call]}

    def _chunk(self, index: int, text: str, finish: str | None, logprobs: Any) -> bytes:
        choice: dict[str, Any] = {"index": self.index}
        if self.kind == "completion":
            choice.update(text=text, logprobs=logprobs, finish_reason=finish, stop_reason=None)
            obj = "text_completion"
        else:
            choice.update(delta=self._delta(index, text), logprobs=logprobs, finish_reason=finish)
            obj = "chat.completion.chunk"
        body = {"id": self.request_id, "object": obj, "created": self.created}
        body.update(model=self.model, choices=[choice])
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def role_chunk(self) -> bytes:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        body = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created}
        body.update(model=self.model, choices=[choice])
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def token_chunks(self, start: int, count: int, finish: str | None) -> bytes:
        parts = []
        for i in range(start, start + count):
            text = self.token_text(i)
            offset = self._text_before(i) if self.fields.num_logprobs is not None else 0
            if i == 0:
                text = self.fields.echo_text + text
                offset = 0
            is_last = i == start + count - 1
            logprobs = self._logprobs(i, 1, offset + (len(text) - len(self.token_text(i))))
            parts.append(self._chunk(i, text, self._finish(finish) if is_last else None, logprobs))
        return b"".join(parts)

    def finish_chunk(self, finish: str) -> bytes:
        return self._chunk(1, "", self._finish(finish), None)

    def full_response(
        self, num_prompt: int, num_completion: int, finish: str, num_cached: int | None = None
    ) -> bytes:
        body = orjson.loads(super().full_response(num_prompt, num_completion, finish, num_cached))
        choice = body["choices"][0]
        choice["index"] = self.index
        generated = "".join(self.token_text(i) for i in range(num_completion))
        text = self.fields.echo_text + generated
        choice["logprobs"] = self._logprobs(0, num_completion, len(self.fields.echo_text))
        choice["finish_reason"] = self._finish(finish)
        if self.kind == "completion":
            choice["text"] = text
        elif self.fields.tool_name is not None:
            function = {"name": self.fields.tool_name, "arguments": generated}
            call = {"id": self._call_id, "type": "function", "function": function}
            choice["message"] = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            choice["message"]["content"] = text
        return orjson.dumps(body)
