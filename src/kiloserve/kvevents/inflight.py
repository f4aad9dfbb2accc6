"""The prompts in flight per backend: blocks an engine holds before its events say so.

An engine's KV events report a prompt's blocks once they are computed; the gateway
learns of them a step later. A request that shares a new prefix with one still in
flight (a burst of a tenant's requests, an agent's parallel calls, the next turn sent
before the last one's events arrived) would find no holder in the exact index and go
anywhere, prefilling the prefix again. But a running request's blocks are pinned in its
engine until it ends, so "sent there and not finished" is as exact as an event: the
exact index counts them too (``KvEventCache.match_depths``).

Requests are grouped by their first block hash; each (first block, backend) keeps its
``max_per_backend`` most recent requests (older ones are forgotten early: less known,
never wrong). Hashes are chained (hash i covers blocks 0..i), so the blocks two
requests share are a common prefix, found by binary search. No copies: the tuples are
the requests' own ``RequestInfo.prefix_hashes``.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["InFlightPrefixes"]


class InFlightPrefixes:
    """(first block hash, backend) -> the prefix hashes of its requests in flight."""

    def __init__(self, max_per_backend: int = 4) -> None:
        self.max_per_backend = max_per_backend
        self._by_first: dict[int, dict[str, list[tuple[int, ...]]]] = {}

    @property
    def num_requests(self) -> int:
        return sum(len(v) for by in self._by_first.values() for v in by.values())

    def add(self, backend_id: str, prefix_hashes: tuple[int, ...]) -> None:
        """A request with these prompt blocks was sent to ``backend_id``."""
        if not prefix_hashes:
            return
        by_backend = self._by_first.setdefault(prefix_hashes[0], {})
        held = by_backend.setdefault(backend_id, [])
        held.append(prefix_hashes)
        if len(held) > self.max_per_backend:
            del held[0]

    def remove(self, backend_id: str, prefix_hashes: tuple[int, ...]) -> None:
        """That request ended (once per ``add``; unknown ones are ignored)."""
        if not prefix_hashes:
            return
        by_backend = self._by_first.get(prefix_hashes[0])
        held = None if by_backend is None else by_backend.get(backend_id)
        if by_backend is None or held is None:
            return
        for i, hashes in enumerate(held):
            if hashes == prefix_hashes:
                del held[i]
                break
        if not held:
            del by_backend[backend_id]
            if not by_backend:
                del self._by_first[prefix_hashes[0]]

    def forget_backend(self, backend_id: str) -> None:
        for first in list(self._by_first):
            by_backend = self._by_first[first]
            by_backend.pop(backend_id, None)
            if not by_backend:
                del self._by_first[first]

    def match_depths(
        self, prefix_hashes: tuple[int, ...], backends: Collection[str]
    ) -> dict[str, int]:
        """Backend (of ``backends``) -> leading blocks of ``prefix_hashes`` that one of
        its in-flight requests shares (> 0)."""
        if not prefix_hashes:
            return {}
        by_backend = self._by_first.get(prefix_hashes[0])
        if not by_backend:
            return {}
        depths: dict[str, int] = {}
        for backend_id, held in by_backend.items():
            if backend_id in backends:
                depths[backend_id] = max(_common(prefix_hashes, h) for h in held)
        return depths


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two chained hash tuples whose first items match."""
    lo, hi = 1, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
