"""Parsing one OpenAI SSE stream as bytes arrive.

``StreamState.feed(data, now)`` takes whatever one socket read returned and the time it
returned; events split across reads are reassembled. Only ``data:`` lines matter:
``[DONE]`` ends the stream, an ``error`` object fails it, a chunk with non-empty
``choices[0].text`` (completions) or ``choices[0].delta.content`` (chat) is a token
chunk, and a ``usage`` object gives the exact output token count.
"""

from __future__ import annotations

import orjson

from kiloserve.results.records import RequestRecord

__all__ = ["StreamState"]


class StreamState:
    """Incremental SSE parser that keeps the ``vllm bench serve`` timestamps."""

    __slots__ = (
        "_buf",
        "_is_chat",
        "_last_s",
        "_start_s",
        "error",
        "is_done",
        "itl_s",
        "num_chunks",
        "ttft_s",
        "usage_prompt_tokens",
        "usage_tokens",
    )

    def __init__(self, start_s: float, *, is_chat: bool) -> None:
        self._start_s = start_s
        self._last_s = start_s
        self._is_chat = is_chat
        self._buf = b""
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.num_chunks = 0
        self.usage_tokens: int | None = None
        self.usage_prompt_tokens: int | None = None
        self.error: str | None = None
        self.is_done = False

    def feed(self, data: bytes, now_s: float) -> None:
        """Consume one read's bytes, all observed at ``now_s``."""
        buf = self._buf + data if self._buf else data
        if b"\n" not in data:
            self._buf = buf
            return
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and not self.is_done:
                self._event(line[5:].strip(), now_s)

    def finish(self, record: RequestRecord) -> None:
        """Copy the results into ``record``; a stream without ``[DONE]`` failed."""
        record.ttft_s = self.ttft_s
        record.itl_s = self.itl_s
        if self.num_chunks:  # vLLM's latency: start to the last token chunk
            record.e2e_s = self._last_s - self._start_s
        record.num_chunks = self.num_chunks
        record.output_tokens = self.usage_tokens if self.usage_tokens else self.num_chunks
        if self.usage_prompt_tokens:  # the server's count beats the workload's nominal one
            record.input_tokens = self.usage_prompt_tokens
        if self.error is None and not self.is_done:
            self.error = "stream ended before [DONE]"
        record.error = self.error
        record.is_ok = self.error is None

    def _event(self, payload: bytes, now_s: float) -> None:
        # Hot path (one call per SSE event): kept flat, no helper calls per token.
        if payload == b"[DONE]":
            self.is_done = True
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._fail("bad JSON in stream")
            return
        if not isinstance(event, dict):
            return
        choices = event.get("choices")
        if choices:
            choice = choices[0]
            if self._is_chat:
                text = (choice.get("delta") or {}).get("content")
            else:
                text = choice.get("text")
            if text:
                if self.ttft_s is None:
                    self.ttft_s = now_s - self._start_s
                else:
                    self.itl_s.append(now_s - self._last_s)
                self._last_s = now_s
                self.num_chunks += 1
        elif "error" in event:
            self._fail(f"stream error: {str(event['error'])[:200]}")
            return
        usage = event.get("usage")
        if usage:
            self.usage_tokens = int(usage.get("completion_tokens") or 0)
            self.usage_prompt_tokens = int(usage.get("prompt_tokens") or 0)

    def _fail(self, message: str) -> None:
        self.error = message
        self.is_done = True
