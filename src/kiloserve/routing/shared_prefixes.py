"""Prefix placements shared by the gateway's worker processes (``--workers N``).

The approximate prefix index (``policies.prefix_index``: which backend this gateway
sent which prefix blocks) lives in each worker's policy. Each worker saw only the
requests the kernel gave it, so with N workers a prompt's prefix could land on up to
N backends, one per worker, before every worker had learned where it went. Here each
worker writes every insert of its index (the backend's slot and the block hashes) to
its own ring in the load segment (``routing.shared_load``; single writer, no lock),
and before each routing decision (``Router.before_decide``) applies its siblings'
new inserts to its own index (``PrefixIndex.insert_quietly``, not published again).

A record is ``slot, n, hash_1 .. hash_n`` (the hashes as the signed 64-bit ints
``tokens.prefix_block_hashes`` makes); the ring's write position is published after
the record is written, so a reader never sees half of one. A reader that fell a whole
ring behind (a stalled worker) skips to the writer's position and counts the lost
placements (``num_lost``): the index is a hint, routing stays correct, only less
sticky. The engines' own KV events (``gateway/kvevents.py``) are exact in every worker
and need none of this.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kiloserve.policies.base import Policy
from kiloserve.policies.prefix_index import PrefixIndex
from kiloserve.routing.ring_cursors import unread
from kiloserve.routing.shared_load import SharedLoad

__all__ = ["SharedPrefixes"]

_LOW, _HIGH = -(1 << 63), (1 << 63) - 1


class SharedPrefixes:
    """One worker's handle on the prefix rings (see the module docstring)."""

    def __init__(self, load: SharedLoad) -> None:
        self._load = load
        self._q = load.views[0]
        lay = load.layout
        self._size = lay.prefix_ring
        self._bases = [lay.prefixes_at + w * (1 + lay.prefix_ring) for w in range(lay.workers)]
        # start at each writer's position: what was placed before this worker started is
        # not replayed (a record's start is not known at an arbitrary ring position)
        self._cursors = [self._q[b] for b in self._bases]
        self._index: PrefixIndex | None = None
        self.num_applied = 0
        self.num_lost = 0

    # -- this worker's inserts -------------------------------------------------------
    def publish(self, prefix_hashes: Sequence[int], backend_id: str) -> None:
        """Write one insert of this worker's index to its ring."""
        slot = self._load.slot(backend_id)
        n = min(len(prefix_hashes), self._size // 4)  # a prefix of a prefix still holds
        if slot is None or n == 0:
            return
        try:
            words = array("q", (slot, n))
            words.extend(prefix_hashes[:n])
        except OverflowError:  # not the gateway's 64-bit hashes: keep it to this worker
            return
        base = self._bases[self._load.worker]
        pos = self._q[base]
        self._write(base, pos, words)
        self._q[base] = pos + len(words)

    def _write(self, base: int, pos: int, words: array[int]) -> None:
        start, size = pos % self._size, self._size
        first = min(len(words), size - start)
        at = base + 1
        self._q[at + start : at + start + first] = memoryview(words[:first])
        if first < len(words):
            rest = len(words) - first
            self._q[at : at + rest] = memoryview(words[first:])

    def _read(self, base: int, pos: int, n: int) -> list[int]:
        start, size = pos % self._size, self._size
        at = base + 1
        first = min(n, size - start)
        out = list(self._q[at + start : at + start + first])
        if first < n:
            out += self._q[at : at + n - first]
        return out

    # -- the siblings' inserts -------------------------------------------------------
    def pull(self, policy: Policy) -> None:
        """Apply the siblings' new inserts to ``policy``'s prefix index (if it keeps
        one), and have it publish its own from now on."""
        index = getattr(policy, "index", None)
        if not isinstance(index, PrefixIndex):
            index = None
        if index is not self._index:  # a new policy (a reload): publish from its index
            if self._index is not None:
                self._index.listener = None
            if index is not None:
                index.listener = self.publish
            self._index = index
        q, me = self._q, self._load.worker
        for w, base, pos, end in unread(q, self._bases, self._cursors, me):
            if end - pos > self._size:
                self.num_lost += 1
                self._cursors[w] = end
                continue
            while pos < end:
                slot, n = self._read(base, pos, 2)
                name = self._load.slot_name(slot) if 0 <= slot < self._load.layout.slots else ""
                if not name or not 0 < n <= self._size // 4:
                    self.num_lost += 1  # overwritten under us: start again at the end
                    break
                if index is not None:
                    index.insert_quietly(self._read(base, pos + 2, n), name)
                    self.num_applied += 1
                pos += 2 + n
            if q[base] - self._cursors[w] > self._size:  # lapped while we read
                self.num_lost += 1
            self._cursors[w] = end
