"""Which backend recently received which prefix blocks: a bounded LRU of block hashes.

``tokens.block_hashes`` are chained (block i's hash covers blocks 0..i), so a backend
holding hash i received the whole prefix up to block i. The index maps a block hash to
the backends that received it (most recent last, at most ``max_num_holders_per_block``)
and keeps at most ``max_num_blocks`` hashes, evicting the least recently dispatched.

``insert`` touches a request's blocks deepest first, so block 0 is the most recent and
eviction removes the deepest blocks first: each backend's set stays a prefix, which is
what lets ``match_depths`` binary-search the depth per backend (O(holders x log L)).
When the per-block holder cap drops a backend from a shallow block only, the depth
found is approximate (as in SGLang's approximate radix tree); routing stays correct,
only less sticky. Lookups never change recency; only ``insert`` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kiloserve.errors import ConfigError
from kiloserve.policies.base import ClusterSnapshot

__all__ = ["DEFAULT_MAX_NUM_BLOCKS", "PrefixIndex", "cached_depths"]

# The policies' default cap (``max_num_blocks``): the largest round number whose
# OrderedDict keeps 2^19 slots under LRU churn. CPython resizes a dict that has used
# up its slots (deletions leave dummies) to the next power of two >= 3x its live
# entries, so an index at 200,000 blocks went to 2^20 slots under churn: 41 MiB at
# steady state (its hash table and the OrderedDict's node array), 61 MiB while
# resizing, not the 27 MiB it took when first full (issue 15's soak). 174,000 blocks
# (3 x 174,000 < 2^19) stay at 25 MiB, 35 MiB while resizing.
DEFAULT_MAX_NUM_BLOCKS = 174_000


def cached_depths(
    index: PrefixIndex,
    snapshot: ClusterSnapshot,
    prefix_hashes: Sequence[int],
    num_tokens: int | None = None,
) -> dict[str, int]:
    """Backend -> leading blocks of ``prefix_hashes`` it holds: from the engines' own KV
    events for the backends whose stream is in order (``snapshot.kv_cache``, exact, in
    what each engine can serve of a ``num_tokens``-token prompt: ``KvEventCache
    .match_depths``), from ``index`` (what this gateway sent where) for the others."""
    approx = index.match_depths(prefix_hashes)
    cache = snapshot.kv_cache
    if cache is None:
        return approx
    exact_ids = cache.exact_backends
    if not exact_ids:
        return approx
    depths = cache.match_depths(tuple(prefix_hashes), num_tokens)
    for backend_id, depth in approx.items():
        if backend_id not in exact_ids:
            depths[backend_id] = depth
    return depths


class PrefixIndex:
    """Bounded LRU: block hash -> backends that received it.

    A block with one holder (the common case) stores the backend id itself, not a
    one-entry dict: about 200 bytes less per block, a third of the index's memory at
    its cap (issue 15's soak: the gateway's RSS grew while it filled). Keep
    ``max_num_blocks`` under a third of a power of two (``DEFAULT_MAX_NUM_BLOCKS``).
    """

    def __init__(self, max_num_blocks: int, max_num_holders_per_block: int) -> None:
        if max_num_blocks < 1 or max_num_holders_per_block < 1:
            raise ConfigError("max_num_blocks and max_num_holders_per_block must be >= 1")
        self.max_num_blocks = max_num_blocks
        self.max_num_holders_per_block = max_num_holders_per_block
        # block hash -> its holder, or its holders (most recent last) when several
        self._holders: OrderedDict[int, str | dict[str, None]] = OrderedDict()
        # told of every ``insert`` (the gateway's sibling workers: routing/shared_prefixes.py)
        self.listener: Callable[[Sequence[int], str], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    def insert(self, prefix_hashes: Sequence[int], backend_id: str) -> None:
        """Record that ``backend_id`` received the blocks ``prefix_hashes`` (and tell
        the ``listener``)."""
        self.insert_quietly(prefix_hashes, backend_id)
        if self.listener is not None:
            self.listener(prefix_hashes, backend_id)

    def insert_quietly(self, prefix_hashes: Sequence[int], backend_id: str) -> None:
        """``insert`` without telling the listener (what another router sent)."""
        index = self._holders
        cap = self.max_num_holders_per_block
        for block_hash in reversed(prefix_hashes):
            holders = index.get(block_hash)
            if holders is None:
                index[block_hash] = backend_id
                continue
            index.move_to_end(block_hash)
            if isinstance(holders, str):
                if holders != backend_id:
                    if cap == 1:
                        index[block_hash] = backend_id
                    else:
                        index[block_hash] = {holders: None, backend_id: None}
                continue
            holders.pop(backend_id, None)
            holders[backend_id] = None
            if len(holders) > cap:
                del holders[next(iter(holders))]
        while len(index) > self.max_num_blocks:
            index.popitem(last=False)

    def forget_backend(self, backend_id: str) -> None:
        """Drop ``backend_id`` everywhere (e.g. after its cache was lost)."""
        index = self._holders
        for block_hash, holders in list(index.items()):
            if holders == backend_id:
                del index[block_hash]
            elif isinstance(holders, dict) and backend_id in holders:
                del holders[backend_id]
                if len(holders) == 1:
                    index[block_hash] = next(iter(holders))

    def match_depths(self, prefix_hashes: Sequence[int]) -> dict[str, int]:
        """Backend id -> number of leading blocks of ``prefix_hashes`` it holds (> 0).

        Candidates are the holders of the first block and of the deepest block present:
        a first block every prompt shares (a common system prompt, the trace's common
        header) keeps only its ``max_num_holders_per_block`` most recent holders, and a
        backend dropped there must still be found through its deeper blocks."""
        if not prefix_hashes:
            return {}
        index = self._holders
        first = index.get(prefix_hashes[0])
        if not first:
            return {}
        candidates = {first} if isinstance(first, str) else set(first)
        deepest = index.get(prefix_hashes[self._deepest_present(prefix_hashes) - 1])
        if deepest is not None and deepest is not first:
            candidates.update((deepest,) if isinstance(deepest, str) else deepest)
        return {bid: self._depth(prefix_hashes, bid) for bid in candidates}

    def _deepest_present(self, prefix_hashes: Sequence[int]) -> int:
        """The number of leading blocks present in the index (any holder); the index is
        kept prefix-closed (deepest blocks are evicted first), so a binary search."""
        index = self._holders
        lo, hi = 1, len(prefix_hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prefix_hashes[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _depth(self, prefix_hashes: Sequence[int], backend_id: str) -> int:
        index = self._holders
        lo, hi = 1, len(prefix_hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            holders = index.get(prefix_hashes[mid - 1])
            held = (
                holders == backend_id
                if isinstance(holders, str)
                else (holders is not None and backend_id in holders)
            )
            if held:
                lo = mid
            else:
                hi = mid - 1
        return lo
