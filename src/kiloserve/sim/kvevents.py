"""KV-cache events in the simulator: the simulated engines feed the gateway's index.

Every simulated engine's block manager gets a ``SimKvSink`` (``engine.block_manager
.KvEventSink``), which turns registrations and evictions into the same ``BlockStored``
/ ``BlockRemoved`` / ``AllBlocksCleared`` events vLLM publishes. Before each routing
decision ``SimKvEvents.deliver`` hands every engine's pending events to the gateway's
``KvEventCache`` as one numbered batch per engine, through ``BackendFeed.on_batch``:
the code path of the live gateway's ZMQ subscriber, minus the socket (events arrive
without delay). The simulator's sequences hash blocks the way the gateway hashes
prompts (``sim.sequence``), so the index takes engine hashes as local hashes
(``IdentityHasher``) instead of re-hashing token ids. A dead engine's feed is lost
(its entries dropped: routing falls back to the approximate index for it); the fresh
engine after recovery numbers its batches from 0 again.

A ``stored`` report is queued as its hashes and parent only; the ``BlockStored`` is
made when its batch is delivered, so the events still pending when the run ends (the
requests routed last finish after the last routing decision) cost one tuple each.
"""

from __future__ import annotations

from kiloserve.engine.sequence import Sequence
from kiloserve.kvevents.feed import KvEventCache
from kiloserve.kvevents.index import IdentityHasher, KvBlockIndex
from kiloserve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

__all__ = ["SimKvEvents", "SimKvSink"]


class SimKvSink:
    """One simulated engine's pending events (a ``KvEventSink``)."""

    __slots__ = ("backend_id", "block_size", "events", "next_seq", "outbox")

    def __init__(self, backend_id: str, block_size: int, outbox: list[SimKvSink]) -> None:
        self.backend_id = backend_id
        self.block_size = block_size
        # in order: events, and stored blocks not yet made events: (hashes, parent)
        self.events: list[Event | tuple[tuple[int, ...], int | None]] = []
        self.outbox = outbox
        self.next_seq = 0

    def _add(self, event: Event) -> None:
        if not self.events:
            self.outbox.append(self)
        self.events.append(event)

    def stored(self, seq: Sequence, begin: int, end: int) -> None:
        hashes = seq.block_hashes
        events = self.events
        if not events:
            self.outbox.append(self)
        events.append((tuple(hashes[begin:end]), hashes[begin - 1] if begin > 0 else None))

    def take_events(self) -> tuple[Event, ...]:
        """The pending events, oldest first (the queue empties)."""
        size = self.block_size
        events = tuple(
            BlockStored(item[0], item[1], (), size) if isinstance(item, tuple) else item
            for item in self.events
        )
        self.events = []
        return events

    def removed(self, block_hashes: list[int]) -> None:
        self._add(BlockRemoved(tuple(block_hashes)))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())


class SimKvEvents:
    """In-process delivery from every simulated engine to the gateway's KV cache."""

    def __init__(self, block_size: int) -> None:
        self.cache = KvEventCache(KvBlockIndex(block_size, IdentityHasher()))
        self.block_size = block_size
        self._outbox: list[SimKvSink] = []

    def new_sink(self, backend_id: str) -> SimKvSink:
        """A sink for a fresh engine (numbering from 0, as a restarted publisher)."""
        return SimKvSink(backend_id, self.block_size, self._outbox)

    def deliver(self) -> None:
        """Hand every pending batch to its backend's feed (in order, one per engine)."""
        outbox = self._outbox
        if not outbox:
            return
        cache = self.cache
        for sink in outbox:
            batch = EventBatch(0.0, sink.take_events())
            cache.feed(sink.backend_id).on_batch(sink.next_seq, batch)
            sink.next_seq += 1
        outbox.clear()

    def engine_lost(self, backend_id: str, sink: SimKvSink | None) -> None:
        """The engine died: its undelivered events go with it, its entries too."""
        if sink is not None and sink.events:
            sink.events = []
            self._outbox.remove(sink)
        self.cache.feed(backend_id).lost()
