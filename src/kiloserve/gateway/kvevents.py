"""The gateway's KV-event subscriber: every publishing backend's ZMQ stream -> one index.

vLLM publishes its prefix cache's changes (``--kv-events-config``, docs/kv-events.md)
on a ZMQ PUB socket and keeps the last batches for a ROUTER replay socket. The gateway
connects (never binds) one SUB socket per backend whose config names a
``kv_events_endpoint`` and feeds ``kvevents.feed.KvEventCache``, which routing reads
through ``BackendTable.kv_cache``:

* live message ``(topic, seq, payload)`` -> ``BackendFeed.on_batch``; a message that
  does not decode is counted (``kiloserve_kv_event_bad_messages_total``) and skipped;
* ``"gap"`` (batches lost): the missing batches are asked from the replay socket with a
  DEALER (``(b"", start_seq)``; no answer for ``replay_timeout_s`` is a failure) and
  applied with ``on_replayed``; live batches that arrive meanwhile wait in the SUB
  socket's queue and are applied after, in order (those the replay already applied are
  skipped as duplicates). Without a replay socket, or when the replay cannot close the
  gap, ``feed.lost()`` drops the backend's entries and the held batch is applied;
* (re)subscribing to a backend with a replay socket first replays from seq 0: the
  engine's cache as far as its buffer reaches.

One poll loop (every ``poll_interval_s``) follows the live ``BackendTable``, whoever
changed it (config, etcd registry): a new backend with an endpoint is subscribed; a
removed one (or one whose endpoints changed) is unsubscribed and ``cache.remove``-d; an
unhealthy one is unsubscribed and ``feed.lost()`` (routing falls back to the
approximate index for it) and subscribed again, with a replay from 0, once healthy. The
``KvEventCache`` is created (and set on the table) with the first subscription, so
routing pays nothing while no backend publishes events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from kiloserve.errors import KvEventError
from kiloserve.kvevents.feed import BackendFeed, KvEventCache
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.wire import END_SEQ, EventBatch, decode_batch, decode_seq, encode_seq

if TYPE_CHECKING:
    from kiloserve.gateway.metrics import GatewayMetrics
    from kiloserve.routing.table import BackendTable

__all__ = ["KvEventSubscriber", "parse_live", "parse_replay"]

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.1
RETRY_INTERVAL_S = 1.0  # after a subscription failed (a bad endpoint, a ZMQ error) ...
MAX_RETRY_INTERVAL_S = 30.0  # ... doubling while it keeps failing before any message
SUB_HWM = 10_000  # live messages queued in the SUB socket (while a replay runs, say)


def parse_live(frames: list[bytes]) -> tuple[int, EventBatch]:
    """``(seq, batch)`` of a SUB message ``(topic, seq, payload)`` (``KvEventError``)."""
    if len(frames) != 3:
        raise KvEventError(f"a live message has 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_seq(frames[1]), decode_batch(frames[2])


def parse_replay(frames: list[bytes]) -> tuple[int, EventBatch] | None:
    """``(seq, batch)`` of one replay answer at the DEALER, None for the end marker.

    vLLM >= 0.11 sends ``(b"", topic, seq, payload)`` and ends with ``(b"", b"",
    END_SEQ, b"")``; older vLLM and SGLang send no topic, ``(b"", seq, payload)`` and
    ``(b"", END_SEQ, b"")``. Both are read.
    """
    rest = frames[1:] if frames and frames[0] == b"" else frames
    if len(rest) < 2:
        return None  # the oldest publishers' bare end marker
    if len(rest) > 3:
        raise KvEventError(f"a replay answer has at most 4 frames, got {len(frames)}")
    if rest[-2] == END_SEQ:
        return None
    return decode_seq(rest[-2]), decode_batch(rest[-1])


class _Stream:
    """One backend's subscription: the SUB socket's loop, gap repair, replays."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        feed: BackendFeed,
        endpoints: tuple[str, str | None],
        metrics: GatewayMetrics,
        replay_timeout_s: float,
    ) -> None:
        self._ctx = ctx
        self.feed = feed
        self.backend_id = feed.backend_id
        self.endpoint, self.replay_endpoint = endpoints
        self._metrics = metrics
        self._replay_timeout_s = replay_timeout_s
        # after a replay, live batches below this seq (queued meanwhile) are duplicates
        self._dup_below = -1
        self._dup_until_s = 0.0
        self.num_messages = 0

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, SUB_HWM)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.endpoint)
            logger.info("backend %s: KV events from %s", self.backend_id, self.endpoint)
            if self.replay_endpoint is not None:  # rebuild what the engine holds already
                await self._replay(self.replay_endpoint, 0)
            while True:
                await self._on_live(await sub.recv_multipart())
        finally:
            sub.close(linger=0)

    def _bad(self, exc: KvEventError) -> None:
        num = self._metrics.kv_bad_message(self.backend_id)
        if num == 1 or num % 1000 == 0:
            logger.warning("backend %s: bad KV event message (%s); %d so far",
                           self.backend_id, exc, num)  # fmt: skip

    async def _on_live(self, frames: list[bytes]) -> None:
        self.num_messages += 1
        try:
            seq, batch = parse_live(frames)
        except KvEventError as exc:
            self._bad(exc)
            return
        feed = self.feed
        if seq < self._dup_below and asyncio.get_running_loop().time() < self._dup_until_s:
            feed.counters.duplicates += 1  # already applied by the replay
            return
        self._dup_below = -1
        verdict = feed.on_batch(seq, batch)
        if verdict == "gap":
            await self._repair(seq, batch)
        elif verdict == "restart":
            logger.info("backend %s: KV event publisher restarted (seq %d): entries dropped",
                        self.backend_id, seq)  # fmt: skip

    async def _repair(self, seq: int, batch: EventBatch) -> None:
        """Close the gap before live ``seq`` from the replay socket, else resync."""
        feed = self.feed
        missing_from = feed.expected
        if self.replay_endpoint is not None and missing_from is not None:
            await self._replay(self.replay_endpoint, missing_from)
        expected = feed.expected
        if expected is not None and expected > seq:
            feed.counters.duplicates += 1  # the replay brought the held batch too
            return
        if expected is not None and expected == seq:
            feed.on_batch(seq, batch)
            return
        logger.warning("backend %s: KV events %s..%d lost and not replayed: entries dropped",
                       self.backend_id, missing_from, seq - 1)  # fmt: skip
        feed.lost()
        feed.on_batch(seq, batch)

    async def _replay(self, endpoint: str, start_seq: int) -> bool:
        """Apply the publisher's buffered batches from ``start_seq``; False when the
        replay socket stops answering for ``replay_timeout_s`` (what came is applied)."""
        dealer = self._ctx.socket(zmq.DEALER)
        num_batches = 0
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            async with asyncio.timeout(self._replay_timeout_s):
                await dealer.send_multipart([b"", encode_seq(start_seq)])
            while True:
                async with asyncio.timeout(self._replay_timeout_s):
                    frames = await dealer.recv_multipart()
                try:
                    item = parse_replay(frames)
                except KvEventError as exc:
                    self._bad(exc)
                    continue
                if item is None:
                    break
                self.feed.on_replayed(*item)
                num_batches += 1
        except TimeoutError:
            logger.warning("backend %s: KV event replay from %s (seq %d) timed out after %d"
                           " batches", self.backend_id, endpoint, start_seq,
                           num_batches)  # fmt: skip
            return False
        finally:
            dealer.close(linger=0)
        expected = self.feed.expected
        self._dup_below = -1 if expected is None else expected
        self._dup_until_s = asyncio.get_running_loop().time() + self._replay_timeout_s
        logger.info("backend %s: replayed %d KV event batches from seq %d",
                    self.backend_id, num_batches, start_seq)  # fmt: skip
        return True


@dataclass(slots=True)
class _Entry:
    """What the subscriber keeps per backend with an endpoint."""

    endpoints: tuple[str, str | None]
    stream: _Stream | None = None
    task: asyncio.Task[None] | None = None
    is_paused: bool = False  # unhealthy: unsubscribed, entries dropped
    retry_at_s: float = 0.0
    num_failures: int = 0  # in a row, without a message in between


class KvEventSubscriber:
    """Subscribes to every backend's KV events while it is in the table and healthy."""

    def __init__(
        self,
        table: BackendTable,
        metrics: GatewayMetrics,
        *,
        block_size: int,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.block_size = block_size
        self.replay_timeout_s = replay_timeout_s
        self.poll_interval_s = poll_interval_s
        self.cache: KvEventCache | None = None
        self._entries: dict[str, _Entry] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._poll_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        """Subscribe to the table's publishing backends now, then follow the table."""
        self.sync()
        self._poll_task = asyncio.create_task(self._poll())

    async def close(self) -> None:
        """Stop every subscription and close the sockets (linger 0)."""
        tasks = list(self._tasks)
        if self._poll_task is not None:
            tasks.append(self._poll_task)
            self._poll_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._entries.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self.sync()

    # -- following the table -------------------------------------------------------
    def _wanted(self) -> dict[str, tuple[tuple[str, str | None], bool]]:
        """Backend -> (endpoints, healthy) for every publishing backend in the table."""
        wanted = {}
        for backend_id in self.table.backend_ids():
            rec = self.table.record(backend_id)
            endpoint = rec.config.kv_events_endpoint
            if endpoint is not None and not rec.is_removing:
                endpoints = (endpoint, rec.config.kv_events_replay_endpoint)
                wanted[backend_id] = (endpoints, rec.state.healthy)
        return wanted

    def sync(self) -> None:
        """Bring the subscriptions in line with the table (membership and health)."""
        wanted = self._wanted()
        for backend_id, entry in list(self._entries.items()):
            if backend_id not in wanted or wanted[backend_id][0] != entry.endpoints:
                self._remove(backend_id, entry)
        now_s = asyncio.get_running_loop().time()
        for backend_id, (endpoints, healthy) in wanted.items():
            entry = self._entries.setdefault(backend_id, _Entry(endpoints))
            self._check_failed(backend_id, entry, now_s)
            if not healthy:
                self._pause(backend_id, entry)
            elif entry.task is None and now_s >= entry.retry_at_s:
                self._subscribe(backend_id, entry)

    def _feed(self, backend_id: str) -> BackendFeed:
        if self.cache is None:
            self.cache = KvEventCache(KvBlockIndex(block_size=self.block_size))
            self.table.kv_cache = self.cache
        return self.cache.feed(backend_id)

    def _subscribe(self, backend_id: str, entry: _Entry) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        stream = _Stream(
            self._ctx, self._feed(backend_id), entry.endpoints, self.metrics, self.replay_timeout_s
        )
        task = asyncio.create_task(stream.run(), name=f"kv-events-{backend_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        entry.stream, entry.task, entry.is_paused = stream, task, False

    def _stop(self, entry: _Entry) -> None:
        if entry.task is not None:
            entry.task.cancel()  # its socket closes as the cancellation unwinds
            entry.task, entry.stream = None, None

    def _pause(self, backend_id: str, entry: _Entry) -> None:
        if entry.is_paused:
            return
        self._stop(entry)
        entry.is_paused = True
        self._drop_entries(backend_id)
        logger.info("backend %s unhealthy: KV events paused, entries dropped", backend_id)

    def _remove(self, backend_id: str, entry: _Entry) -> None:
        self._stop(entry)
        del self._entries[backend_id]
        if self.cache is not None:
            self.cache.remove(backend_id)
        self.metrics.kv_bad_messages.pop(backend_id, None)
        logger.info("backend %s: KV events unsubscribed", backend_id)

    def _check_failed(self, backend_id: str, entry: _Entry, now_s: float) -> None:
        """A subscription that died of an error: entries dropped, retried later."""
        task = entry.task
        if task is None or not task.done():
            return
        if entry.stream is not None and entry.stream.num_messages:
            entry.num_failures = 0
        delay_s = min(MAX_RETRY_INTERVAL_S, RETRY_INTERVAL_S * 2**entry.num_failures)
        entry.task, entry.stream = None, None
        entry.num_failures += 1
        entry.retry_at_s = now_s + delay_s
        exc = None if task.cancelled() else task.exception()
        logger.warning("backend %s: KV event subscription to %s failed (%r); retrying in %g s",
                       backend_id, entry.endpoints[0], exc, delay_s)  # fmt: skip
        self._drop_entries(backend_id)

    def _drop_entries(self, backend_id: str) -> None:
        """``feed.lost()`` unless nothing was applied since the last loss."""
        feed = self._feed(backend_id)
        if feed.expected is not None:
            feed.lost()

    # -- reading -------------------------------------------------------------------
    def describe(self) -> dict[str, dict[str, Any]]:
        """Per publishing backend: mode, endpoints, counters, blocks (``/admin/config``)."""
        cache = self.cache
        feeds = {f.backend_id: f for f in cache.feeds()} if cache is not None else {}
        rows = {}
        for backend_id, entry in self._entries.items():
            feed = feeds.get(backend_id)
            c = feed.counters if feed is not None else None
            rows[backend_id] = {
                "mode": cache.mode(backend_id) if cache is not None else "approximate",
                "endpoint": entry.endpoints[0],
                "replay_endpoint": entry.endpoints[1],
                "subscribed": entry.task is not None,
                "batches": c.batches if c else 0,
                "events": c.events if c else 0,
                "gaps": c.gaps if c else 0,
                "resyncs": c.resyncs + c.losses if c else 0,
                "restarts": c.restarts if c else 0,
                "blocks": cache.index.num_backend_blocks(backend_id) if cache is not None else 0,
                "bad_messages": self.metrics.kv_bad_messages.get(backend_id, 0),
            }
        return rows
