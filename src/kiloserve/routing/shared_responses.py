"""Responses API ids shared by the gateway's worker processes (``--workers N``).

vLLM keeps a Responses API conversation in the memory of the engine that answered it,
so a follow-up with ``previous_response_id`` must reach that engine; any other answers
404 ("Response with id ... not found"). The gateway remembers which backend produced
each response id (``gateway/extra_apis.py``, ``ResponseOwners``), but each worker
learnt only the answers it relayed itself: a follow-up on another connection, which
the kernel may give to another worker, was routed by the policy to any backend, and
the user saw the 404.

Here each worker writes every id it learns, as a 64-bit hash of the id and the slot of
its backend (``routing.shared_load``), to its own ring in the load segment (single
writer, no lock): the entry first, then the count of entries written. Before a
look-up a worker reads its siblings' entries written since it last read (``pull``);
a worker that starts (or replaces a dead one) reads each sibling's whole ring first,
so the ids it relayed before are known to it too. An entry a writer overwrote while
it was read is dropped and counted (``num_lost``), as are the entries of a ring that
lapped its reader: a ring holds ``response_ring / 2`` entries per worker (131,072 by
default, more than one worker's ``MAX_RESPONSE_IDS``).
"""

from __future__ import annotations

import hashlib

from kiloserve.routing.ring_cursors import unread
from kiloserve.routing.shared_load import SharedLoad

__all__ = ["SharedResponses", "response_key"]

_ENTRY = 2  # id hash, slot


def response_key(response_id: str) -> int:
    """The id's 64-bit hash as a signed int (an int64 word), equal in every process."""
    digest = hashlib.blake2b(response_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class SharedResponses:
    """One worker's handle on the Responses id rings (see the module docstring)."""

    def __init__(self, load: SharedLoad) -> None:
        self._load = load
        self._q = load.views[0]
        lay = load.layout
        self._capacity = lay.response_ring // _ENTRY
        self._bases = [lay.responses_at + w * (1 + lay.response_ring) for w in range(lay.workers)]
        # every sibling's whole ring is read at the first pull
        self._cursors = [max(0, self._q[b] - self._capacity) for b in self._bases]
        self.num_lost = 0

    def publish(self, key: int, backend_id: str) -> None:
        """Write that this worker learnt ``key`` (``response_key``) on ``backend_id``."""
        slot = self._load.slot(backend_id)
        if slot is None:
            return
        q, base = self._q, self._bases[self._load.worker]
        i = q[base]
        at = base + 1 + (i % self._capacity) * _ENTRY
        q[at] = key
        q[at + 1] = slot
        q[base] = i + 1

    def pull(self) -> list[tuple[int, str]]:
        """The siblings' entries written since the last pull: ``(key, backend id)``,
        oldest first per sibling."""
        q, me, cap = self._q, self._load.worker, self._capacity
        num_slots = self._load.layout.slots
        out: list[tuple[int, str]] = []
        for w, base, pos, end in unread(q, self._bases, self._cursors, me):
            if end - pos > cap:  # lapped: the oldest are gone
                self.num_lost += end - pos - cap
                pos = end - cap
            got = []
            for i in range(pos, end):
                at = base + 1 + (i % cap) * _ENTRY
                got.append((i, q[at], q[at + 1]))
            still_there = q[base] - cap  # entries before this were overwritten meanwhile
            for i, key, slot in got:
                name = self._load.slot_name(slot) if 0 <= slot < num_slots else ""
                if i < still_there or not name:
                    self.num_lost += 1
                    continue
                out.append((key, name))
            self._cursors[w] = end
        return out
