"""Per-backend event streams into one shared ``KvBlockIndex``: order, gaps, restarts.

``KvEventCache`` is what routing reads: the exact index plus, per backend, whether it
is *exact* (its stream is in order and applied) or *approximate* (no stream, a gap
not yet repaired, or a stream lost; routing then uses the approximate index for it).
The ZMQ subscriber (gateway) and the simulator's engines feed it through the same
``BackendFeed.on_batch``:

* first batch, or ``seq == expected``: applied; the backend is exact;
* ``seq > expected`` (batches lost): ``"gap"``; the caller fetches the missing batches
  from the publisher's replay socket and hands them to ``on_replayed``, then the held
  batch; if the replay cannot close the gap, ``lost()`` drops the backend's entries;
* ``seq < expected`` (outside a replay): the publisher restarted (its numbering
  starts again at 0 and its cache is empty): the backend's entries are dropped, the
  batch applied, the backend stays exact.

``lost()`` (stream gone, backend unhealthy or removed) drops the entries and makes
the backend approximate until its next batch is applied in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.inflight import InFlightPrefixes
from kiloserve.kvevents.wire import EventBatch

__all__ = ["BackendFeed", "FeedCounters", "KvEventCache", "Mode"]

Mode = Literal["exact", "approximate"]
Verdict = Literal["applied", "gap", "restart", "duplicate"]


@dataclass(slots=True)
class FeedCounters:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    resyncs: int = 0
    restarts: int = 0
    losses: int = 0
    duplicates: int = 0


class BackendFeed:
    """One backend's stream: sequence numbers in, index updates out."""

    def __init__(self, cache: KvEventCache, backend_id: str) -> None:
        self._cache = cache
        self.backend_id = backend_id
        self.expected: int | None = None
        self.mode: Mode = "approximate"
        self.counters = FeedCounters()

    def _apply(self, seq: int, batch: EventBatch) -> None:
        self._cache.index.apply(self.backend_id, batch.events)
        self.expected = seq + 1
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        self._set_mode("exact")

    def on_batch(self, seq: int, batch: EventBatch) -> Verdict:
        """A live batch. ``"gap"`` means nothing was applied: replay, then call
        ``on_replayed`` for the missing batches and ``on_batch`` again for this one."""
        expected = self.expected
        if expected is None or seq == expected:
            self._apply(seq, batch)
            return "applied"
        if seq > expected:
            self.counters.gaps += 1
            return "gap"
        self.counters.restarts += 1
        self._cache.index.clear_backend(self.backend_id)
        self._apply(seq, batch)
        return "restart"

    def on_replayed(self, seq: int, batch: EventBatch) -> Verdict:
        """A batch from the replay socket: applied in order, duplicates skipped. A
        first replayed batch past ``expected`` means the publisher's buffer no longer
        holds the gap: the entries are dropped (resync) and it is applied."""
        expected = self.expected
        if expected is not None and seq < expected:
            self.counters.duplicates += 1
            return "duplicate"
        if expected is not None and seq > expected:
            self.counters.resyncs += 1
            self._cache.index.clear_backend(self.backend_id)
        self._apply(seq, batch)
        return "applied"

    def lost(self) -> None:
        """The stream is gone or cannot be repaired: forget the backend's blocks."""
        self.counters.losses += 1
        self._cache.index.clear_backend(self.backend_id)
        self.expected = None
        self._set_mode("approximate")

    def _set_mode(self, mode: Mode) -> None:
        if mode != self.mode:
            self.mode = mode
            self._cache.mode_changed(self.backend_id, mode)


class KvEventCache:
    """The exact index and every backend's feed; routing asks ``exact_backends``.

    ``in_flight``: the prompts sent to each backend and not finished (the table's
    ``on_dispatch`` / ``on_complete``): their blocks are pinned in the engine, so they
    count as held before the engine's events for them arrive (``kvevents.inflight``).
    """

    def __init__(self, index: KvBlockIndex) -> None:
        self.index = index
        self.in_flight = InFlightPrefixes()
        self._feeds: dict[str, BackendFeed] = {}
        self._exact: set[str] = set()
        self.exact_backends: frozenset[str] = frozenset()

    def feed(self, backend_id: str) -> BackendFeed:
        feed = self._feeds.get(backend_id)
        if feed is None:
            feed = self._feeds[backend_id] = BackendFeed(self, backend_id)
        return feed

    def feeds(self) -> list[BackendFeed]:
        return list(self._feeds.values())

    def mode(self, backend_id: str) -> Mode:
        return "exact" if backend_id in self._exact else "approximate"

    def remove(self, backend_id: str) -> None:
        """The backend left the table: its feed and blocks go."""
        feed = self._feeds.pop(backend_id, None)
        if feed is not None:
            feed.lost()
        self.index.clear_backend(backend_id)
        self.in_flight.forget_backend(backend_id)

    def mode_changed(self, backend_id: str, mode: Mode) -> None:
        if mode == "exact":
            self._exact.add(backend_id)
        else:
            self._exact.discard(backend_id)
        self.exact_backends = frozenset(self._exact)

    def match_depths(
        self, prefix_hashes: tuple[int, ...], num_tokens: int | None = None
    ) -> dict[str, int]:
        """Depths (in the index's blocks) for the exact backends (others are the
        approximate index's), from their events and their requests in flight, as each
        engine can serve them: whole engine blocks (an
        engine block of ``k`` index blocks is used whole or not at all) and, given the
        prompt's ``num_tokens``, at most its first ``num_tokens - 1`` tokens in whole
        engine blocks (vLLM computes at least the last token)."""
        if not self._exact:
            return {}
        exact = self.exact_backends
        depths = self.index.match_depths(prefix_hashes, exact)
        # requests in flight count where they hold more than the events say (floors)
        depths.update(self.in_flight.match_depths(prefix_hashes, exact, depths))
        for backend_id, depth in depths.items():
            depths[backend_id] = self.servable_depth(backend_id, depth, num_tokens)
        return {b: d for b, d in depths.items() if d > 0}

    def servable_depth(self, backend_id: str, depth: int, num_tokens: int | None) -> int:
        """``depth`` index blocks held by ``backend_id`` as its engine can serve them for
        a ``num_tokens``-token prompt (see ``match_depths``)."""
        index = self.index
        size = index.block_size
        engine_size = index.engine_block_size(backend_id) or size
        tokens = depth * size // engine_size * engine_size
        if num_tokens is not None:
            tokens = min(tokens, max(0, num_tokens - 1) // engine_size * engine_size)
        return tokens // size
