"""The twin's KV-event publisher: vLLM's ``ZmqEventPublisher`` semantics over pyzmq.

* PUB socket bound at ``endpoint``: one multipart message per batch, ``(topic, seq,
  payload)``: ``seq`` 8 bytes big-endian, 0 for the first batch and +1 per batch,
  ``payload`` the msgpack ``KVEventBatch`` (``kvevents.wire.encode_batch``). Sends
  never block: past the high-water mark (100,000 messages) a slow subscriber misses
  batches, sees the gap in ``seq`` and asks the replay socket.
* ROUTER socket bound at ``replay_endpoint`` (optional): a request ``("", start_seq)``
  from a DEALER (8 bytes big-endian) is answered with ``("", topic, seq, payload)``
  for every buffered batch with ``seq >= start_seq``, then ``("", "", END_SEQ, "")``.
  The buffer holds the last ``buffer_steps`` batches (10,000, as vLLM).

One difference from vLLM: the twin binds every endpoint it is given (vLLM binds only
wildcard and ``ipc://`` endpoints and connects to the others), so subscribers always
connect. ``tcp://127.0.0.1:0`` binds a free port; ``endpoint`` / ``replay_endpoint``
then read the bound address back (``zmq.LAST_ENDPOINT``).

Runs in the twin's asyncio loop: ``publish`` is a plain call (encode, buffer, send
without blocking) made by ``TwinLoop`` after each engine step with events, and replay
requests are served by one task on a ``zmq.asyncio`` socket. ``start`` binds (a
``ConfigError`` naming the endpoint when it cannot), ``close`` closes both sockets
with linger 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from kiloserve.errors import ConfigError
from kiloserve.kvevents.wire import END_SEQ, Event, EventBatch, encode_batch, encode_seq

__all__ = ["DEFAULT_BUFFER_STEPS", "KvEventPublisher"]

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000


class KvEventPublisher:
    """PUB + replay ROUTER for one engine's KV events (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        topic: str = "",
        hwm: int = DEFAULT_HWM,
        data_parallel_rank: int = 0,
    ) -> None:
        if buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._endpoint_arg = endpoint
        self._replay_endpoint_arg = replay_endpoint
        self.endpoint: str | None = None  # bound addresses, once started
        self.replay_endpoint: str | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._hwm = hwm
        self._rank = data_parallel_rank
        self.next_seq = 0
        self.num_replays = 0
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def is_started(self) -> bool:
        return self._pub is not None

    def start(self) -> None:
        """Bind both sockets and serve replays (call inside the running event loop)."""
        if self._ctx is not None:
            raise RuntimeError("KV event publisher already started")
        ctx = self._ctx = zmq.Context()
        try:
            pub = self._pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            self.endpoint = _bind(pub, self._endpoint_arg, "KV events")
            if self._replay_endpoint_arg is not None:
                router = self._router = zmq.asyncio.Socket(ctx, zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by the buffer
                self.replay_endpoint = _bind(router, self._replay_endpoint_arg, "KV replay")
        except BaseException:
            self._close_sockets()
            raise
        if self._router is not None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._serve_replays(self._router), name="kv-replay")

    def publish(self, events: Iterable[Event], ts: float | None = None) -> int:
        """Send ``events`` as one batch (``ts`` default: now); returns its ``seq``."""
        pub = self._pub
        if pub is None:
            raise RuntimeError("KV event publisher is not started, or closed")
        batch = EventBatch(time.time() if ts is None else ts, tuple(events), self._rank)
        payload = encode_batch(batch)
        seq = self.next_seq
        self.next_seq = seq + 1
        self._buffer.append((seq, payload))
        try:
            pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # kept for replay; subscribers see the gap
            logger.warning("KV events: batch %d not sent (%s)", seq, exc)
        return seq

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            try:
                await self._answer(router, frames)
            except zmq.ZMQError as exc:
                logger.warning("KV events: replay failed (%s)", exc)

    async def _answer(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """Every buffered batch from the requested ``seq`` on, then ``END_SEQ``."""
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames) ignored", len(frames))
            return
        client_id, _, start_frame = frames
        start_seq = int.from_bytes(start_frame, "big", signed=True)
        wanted = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        for seq, payload in wanted:
            await router.send_multipart((client_id, b"", self._topic, encode_seq(seq), payload))
        await router.send_multipart((client_id, b"", b"", END_SEQ, b""))
        self.num_replays += 1

    async def close(self) -> None:
        """Stop serving replays and close both sockets (linger 0); idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    async def __aenter__(self) -> KvEventPublisher:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _bind(sock: zmq.Socket[Any], endpoint: str, what: str) -> str:
    """Bind ``sock`` and return the bound address (a port 0 read back)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind the {what} socket to {endpoint!r}: {exc}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
