"""A consistent-hash ring over group names, with stable (process-independent) hashes.

Each name gets ``num_vnodes`` points at ``blake2b("name#i")``; a key walks clockwise
from ``blake2b(key)`` and meets names in ring order. Adding or removing one of n names
moves about 1/n of the keys. Rings are cached by ``RingCache`` keyed on the tuple of
names, so a ring is rebuilt only when a pool's membership changes.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Sequence

from kiloserve.policies.base import BackendState, ClusterSnapshot

__all__ = ["HashRing", "RingCache", "group_name", "group_names", "stable_hash64"]


def group_name(b: BackendState) -> str:
    """The ring name of ``b``'s group: ``BackendState.group``, or the backend alone.

    Group names and backend ids share one namespace: do not name a group after a
    backend of another group.
    """
    return b.group or b.backend_id


def group_names(pool: Sequence[BackendState]) -> tuple[str, ...]:
    """Ring names of a whole pool (healthy or not), so health changes keep the ring."""
    return tuple(sorted({b.group or b.backend_id for b in pool}))


def stable_hash64(key: str) -> int:
    """64-bit hash of ``key``, equal in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class HashRing:
    """Sorted virtual-node points; ``walk`` yields distinct names clockwise."""

    def __init__(self, names: Iterable[str], num_vnodes: int) -> None:
        points = sorted(
            (stable_hash64(f"{name}#{i}"), name) for name in set(names) for i in range(num_vnodes)
        )
        self._points = [p for p, _ in points]
        self._names = [name for _, name in points]
        self.num_names = len({name for _, name in points})

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct names in clockwise order from ``key_hash``."""
        n = len(self._points)
        start = bisect.bisect_left(self._points, key_hash)
        seen: set[str] = set()
        for k in range(n):
            name = self._names[(start + k) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == self.num_names:
                    return


class RingCache:
    """Keeps the rings of the last few name sets (bounded).

    ``pool_ring`` also remembers, per model, the pool tuple it last saw (held, so its
    identity cannot be reused): a caller that keeps its pool tuples across snapshots
    (the gateway does) skips the O(pool) name scan. Tuples are immutable, so a pool
    whose membership changed is a new tuple and gets its ring rebuilt.
    """

    def __init__(self, num_vnodes: int, max_num_rings: int = 16) -> None:
        self.num_vnodes = num_vnodes
        self.max_num_rings = max_num_rings
        self._rings: dict[tuple[str, ...], HashRing] = {}
        self._last: dict[str, tuple[tuple[BackendState, ...], HashRing]] = {}

    def pool_ring(self, snapshot: ClusterSnapshot, model: str) -> HashRing:
        """The ring over every group of ``model``'s pool in ``snapshot``."""
        pool = snapshot.pool(model)
        last = self._last.get(model)
        if last is not None and last[0] is pool:
            return last[1]
        ring = self.ring(group_names(pool))
        self._last[model] = (pool, ring)
        return ring

    def ring(self, names: tuple[str, ...]) -> HashRing:
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= self.max_num_rings:
                del self._rings[next(iter(self._rings))]
            ring = self._rings[names] = HashRing(names, self.num_vnodes)
        return ring
