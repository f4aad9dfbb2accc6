"""Paged KV cache with a prefix cache, modelled on vLLM v1's KVCacheManager.

Blocks hold ``block_size`` tokens. Block 0 is the null block (as in vLLM) and is
never handed out, so ``num_blocks - 1`` blocks hold tokens. A full block whose
tokens are computed is registered under its chained hash (hash of block i covers
blocks 0..i); a later sequence with the same prefix reuses it (reference counted).

Free blocks are taken in this order: blocks freed without a hash (they hold nothing
reusable), then never-used blocks, then cached blocks, least recently freed first
(LRU eviction). Cached blocks no sequence holds count as free, as in vLLM's
``kv_cache_usage_perc = 1 - free / (num_blocks - 1)``. Block state is created lazily,
so a simulator can hold thousands of engines with large, mostly idle caches.
"""

from __future__ import annotations

from collections import OrderedDict

from kiloserve.engine.sequence import Sequence

__all__ = ["BlockManager"]


class BlockManager:
    """Owns every KV block; pairs each check with its action."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts: list[int] = [0]  # index = block id; grows as blocks are first used
        self._hashes: list[int | None] = [None]
        self._num_fresh_blocks = num_blocks - 1
        self._free_uncached: list[int] = []
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + self._num_fresh_blocks + len(self._free_cached)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (held or free)."""
        return len(self._hash_to_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id] if block_id < len(self._ref_counts) else 0

    def free_block_order(self) -> list[int]:
        """Ids of free, already-used blocks in the order they would be taken (for tests)."""
        return list(reversed(self._free_uncached)) + list(self._free_cached)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Leading blocks of ``seq`` present in the prefix cache.

        The last token is always left to compute (as in vLLM), so a full hit stops one
        block short when the tokens fill whole blocks.
        """
        if not self.enable_prefix_caching:
            return []
        max_num_hit_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_num_hit_blocks]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, cached_block_ids: list[int], num_new_tokens: int) -> bool:
        """Room for a waiting sequence: its cache hits plus ``num_new_tokens`` after them."""
        num_hit_tokens = len(cached_block_ids) * self.block_size
        num_new_blocks = self.num_blocks_for(num_hit_tokens + num_new_tokens) - len(
            cached_block_ids
        )
        num_free_hits = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        return num_new_blocks + num_free_hits <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int) -> None:
        """Admit ``seq``: take its cache hits, count the query, add blocks for new tokens."""
        for block_id in cached_block_ids:
            self._take_cached(block_id)
        num_hit_tokens = len(cached_block_ids) * self.block_size
        seq.block_table = list(cached_block_ids)
        seq.num_hashed_blocks = len(cached_block_ids)
        seq.num_computed_tokens = num_hit_tokens
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            # As vLLM's PrefixCacheStats: a preempted request's re-admission is not a
            # new query (vLLM tracks it apart, outside prefix_cache_queries/hits).
            self.prefix_cache_queries_tokens += seq.num_tokens
            self.prefix_cache_hits_tokens += num_hit_tokens
        self._grow(seq, num_hit_tokens + num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room to compute ``num_new_tokens`` more tokens of a running sequence."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return self.num_blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add the blocks (if any) that ``num_new_tokens`` more tokens need."""
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def append_block(self, seq: Sequence) -> None:
        """Give ``seq`` one more block (used by fused decode steps)."""
        seq.block_table.append(self._take_free())

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache every full block among the first ``num_tokens`` (computed) tokens."""
        num_full_blocks = num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full_blocks <= seq.num_hashed_blocks:
            return
        hash_to_block, hashes = self._hash_to_block, self._hashes
        block_table, block_hashes = seq.block_table, seq.block_hashes
        for index in range(seq.num_hashed_blocks, num_full_blocks):
            block_hash = block_hashes[index]
            if block_hash not in hash_to_block:
                block_id = block_table[index]
                hashes[block_id] = block_hash
                hash_to_block[block_hash] = block_id
        seq.num_hashed_blocks = num_full_blocks

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, last block first (so tail blocks are evicted first)."""
        ref_counts, hashes = self._ref_counts, self._hashes
        free_uncached, free_cached = self._free_uncached, self._free_cached
        for block_id in reversed(seq.block_table):
            num_refs = ref_counts[block_id] - 1
            ref_counts[block_id] = num_refs
            if num_refs > 0:
                continue
            if hashes[block_id] is None:
                free_uncached.append(block_id)
            else:
                free_cached[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        num_new_blocks = -(-num_tokens // self.block_size) - len(seq.block_table)
        if num_new_blocks == 1:
            seq.block_table.append(self._take_free())
        elif num_new_blocks > 1:
            seq.block_table += self._take_free_blocks(num_new_blocks)
        self.register_full_blocks(seq, num_tokens)

    def _take_free_blocks(self, num_blocks: int) -> list[int]:
        """``num_blocks`` calls of ``_take_free`` in one go (same ids, same order)."""
        free_uncached, ref_counts = self._free_uncached, self._ref_counts
        num_reused = min(num_blocks, len(free_uncached))
        split = len(free_uncached) - num_reused
        taken = free_uncached[split:][::-1]
        del free_uncached[split:]
        for block_id in taken:
            ref_counts[block_id] = 1
        num_fresh = min(num_blocks - num_reused, self._num_fresh_blocks)
        if num_fresh > 0:
            first_id = len(ref_counts)
            taken += range(first_id, first_id + num_fresh)
            ref_counts += [1] * num_fresh
            self._hashes += [None] * num_fresh
            self._num_fresh_blocks -= num_fresh
        num_evicted = num_blocks - num_reused - num_fresh
        if num_evicted > 0:  # _evict_lru, inlined (the steady state: a full cache)
            popitem, hashes, hash_to_block = (
                self._free_cached.popitem,
                self._hashes,
                self._hash_to_block,
            )
            for _ in range(num_evicted):
                block_id = popitem(False)[0]
                block_hash = hashes[block_id]
                if block_hash is not None:
                    del hash_to_block[block_hash]
                    hashes[block_id] = None
                ref_counts[block_id] = 1
                taken.append(block_id)
        return taken

    def _take_cached(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free_cached[block_id]
        self._ref_counts[block_id] += 1

    def _take_free(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.pop()
        elif self._num_fresh_blocks > 0:
            block_id = len(self._ref_counts)
            self._ref_counts.append(0)
            self._hashes.append(None)
            self._num_fresh_blocks -= 1
        else:
            block_id = self._evict_lru()
        self._ref_counts[block_id] = 1
        return block_id

    def _evict_lru(self) -> int:
        block_id, _ = self._free_cached.popitem(last=False)
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._hashes[block_id] = None
        return block_id
