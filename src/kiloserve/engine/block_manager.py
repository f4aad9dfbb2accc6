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

Private blocks (a speed path for the simulator, same behaviour): a sequence may say
that its blocks from ``private_from_block`` on hold text no other sequence has (the
simulator knows which prompts are unique). No other sequence can hit such a block,
so it is not entered in the hash index: registering it only counts it, and freeing a
sequence puts its registered private blocks into the LRU as one *segment* (one entry,
in the order single blocks would have gone in), evicted from its front like single
blocks. The sequence itself finds what is left of its segment when it is re-admitted
after a preemption, as it would find its hashes. Free counts, eviction order, hits
and block ids are exactly those of the per-block path; what is saved is per-block
Python work (a prompt's blocks move as a few list slices).

The LRU (a speed path, same order): free cached blocks wait in a ``deque`` of block ids
(and private segment keys), least recently freed first, as an ``OrderedDict`` would
hold them; freeing appends, eviction pops from the front. A hit on a free cached block
takes it back without searching the deque: its entry stays, counted as dead in
``_stale[block]``, and eviction skips it. A block's dead entries always come before its
live one (only its newest entry can be live), so skipping the first ``_stale[block]``
entries of a block met at the front keeps the order exact. The deque is rebuilt
without its dead entries once they outnumber the live ones; a segment's entry is dead
once the segment was taken back whole. Freeing a prompt's blocks is one
``deque.extend`` (an ``OrderedDict`` insert per block cost ~700 machine instructions;
a fifth of a Mooncake run's event loop).

Run registration (same speed idea for shared blocks): a run of newly full blocks none
of whose hashes is cached yet (a prompt past its hits, the common case) enters the
hash index with one ``setdefault`` per block (a block whose hash was there already
undoes the run's entries) and is reported as one ``stored`` run; a run with a cached
hash (or a hash twice) goes through the per-block loop, which decides exactly as
before (``tests/unit/engine/test_block_manager_runs.py``). The per-block loops read ids
through ``object`` views: compiled, an int read from a ``list[int]`` is unboxed, and
boxing it again allocates a new int object.

KV-cache events: a ``KvEventSink`` in ``kv_sink`` is told of every change to the hash
index, the facts vLLM publishes with ``--kv-events-config``: each run of blocks newly
registered by ``register_full_blocks`` (``stored``), the hashes each eviction drops
(``removed``) and a full reset (``cleared``). Private blocks are never in the index,
so never reported. With no sink (the simulator's default) the hot paths pay one
attribute test per call (per evicted block in ``_evict``).

KV tiers (``kv_tiers.KvTiers`` in ``tiers``, None without tiers): every hashed block
``_evict`` drops is offloaded to them, and ``find_tier_blocks`` / ``load_from_tiers``
continue a prefix lookup past the GPU hits (the scheduler allocates the loaded
blocks like newly computed ones, then counts them as computed). Private blocks are
never tiered (nobody else could hit them).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, cast

from kiloserve.engine.kv_tiers import KvTiers
from kiloserve.engine.sequence import Sequence

__all__ = ["BlockManager", "KvEventSink"]


class KvEventSink(Protocol):
    """What ``BlockManager`` tells of its prefix cache (``engine.kvlog.KvEventLog``
    turns it into vLLM's KV events; the simulator feeds its gateway's index)."""

    def stored(self, seq: Sequence, begin: int, end: int) -> None:
        """Blocks ``begin .. end - 1`` of ``seq`` were newly registered: their hashes are
        ``seq.block_hashes[begin:end]``, their parent ``seq.block_hashes[begin - 1]``
        (None when ``begin`` is 0). Called once per run of new blocks."""
        ...

    def removed(self, block_hashes: list[int]) -> None:
        """Cached blocks were evicted: these hashes left the index (never empty)."""
        ...

    def cleared(self) -> None:
        """Every cached block was dropped at once (``reset_prefix_cache``)."""
        ...


# Block ids as shared int objects, grown on demand: handing out fresh blocks copies a
# slice of this list instead of creating an int per block (most ids are above the
# interpreter's small-int cache). Ints are immutable, so every manager can share them.
_BLOCK_IDS: list[int] = []


def _block_ids(start: int, stop: int) -> list[int]:
    """``list(range(start, stop))``, its ints shared with every earlier call."""
    if stop > len(_BLOCK_IDS):
        _BLOCK_IDS.extend(range(len(_BLOCK_IDS), stop))
    return _BLOCK_IDS[start:stop]


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
        # The LRU of free cached blocks (module doc, "The LRU"): block ids and private
        # segment keys, least recently freed first; a block taken back by a hit leaves
        # its entry behind, counted in _stale[block], and eviction skips it
        self._lru: deque[int] = deque()
        self._stale: list[int] = [0]  # index = block id: its dead entries in _lru
        self._num_free_cached = 0  # shared blocks free and cached (live entries)
        self.lru_slack = 4096  # dead LRU entries allowed beyond the live ones' count
        self._hash_to_block: dict[int, int] = {}
        # free private segments: LRU entries keyed by negative numbers (block ids are > 0),
        # each a list of block ids in eviction order
        self._segments: dict[int, list[int]] = {}
        self._num_segment_blocks = 0
        self._last_segment_key = 0
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0
        self.kv_sink: KvEventSink | None = None
        self.tiers: KvTiers | None = None

    @property
    def num_free_blocks(self) -> int:
        num_cached = self._num_free_cached + self._num_segment_blocks
        return len(self._free_uncached) + self._num_fresh_blocks + num_cached

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        """Shared blocks registered in the prefix cache (held or free), plus free private
        blocks still cached (held private blocks are not counted)."""
        return len(self._hash_to_block) + self._num_segment_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """Holders of a block at a shared position (private blocks are not counted)."""
        return self._ref_counts[block_id] if block_id < len(self._ref_counts) else 0

    def free_block_order(self) -> list[int]:
        """Ids of free, already-used blocks in the order they would be taken (for tests)."""
        order = list(reversed(self._free_uncached))
        for key in self._live_entries():
            if key < 0:
                order += self._segments[key]
            else:
                order.append(key)
        return order

    def _live_entries(self) -> list[int]:
        """The LRU's live entries (block ids, segment keys), oldest first: a segment's
        entry is dead once it was taken back whole, a block's first ``_stale[block]``
        entries are (its dead entries come before its live one)."""
        stale: dict[int, int] = {}  # dead entries of a block still ahead
        live: list[int] = []
        for key in self._lru:
            if key < 0:
                if key in self._segments:
                    live.append(key)
                continue
            num_dead = stale.get(key, self._stale[key])
            if num_dead:
                stale[key] = num_dead - 1
            else:
                live.append(key)
        return live

    @staticmethod
    def _num_shared(seq: Sequence, num_blocks: int) -> int:
        """How many of ``seq``'s first ``num_blocks`` blocks are shared (not private)."""
        private = seq.private_from_block
        return num_blocks if private is None else min(num_blocks, private)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Leading blocks of ``seq`` present in the prefix cache.

        The last token is always left to compute (as in vLLM), so a full hit stops one
        block short when the tokens fill whole blocks. Past the shared blocks, hits can
        only be what is left of ``seq``'s own free private segment.
        """
        if not self.enable_prefix_caching:
            return []
        max_num_hit_blocks = (seq.num_tokens - 1) // self.block_size
        num_shared = self._num_shared(seq, max_num_hit_blocks)
        hits: list[int] = []
        for block_hash in seq.block_hashes[:num_shared]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                return hits
            hits.append(block_id)
        if len(hits) == num_shared < max_num_hit_blocks and seq.free_segment_key:
            segment = self._segments.get(seq.free_segment_key)
            if segment:  # table order is the reverse of eviction order
                hits += segment[::-1][: max_num_hit_blocks - num_shared]
        return hits

    def find_tier_blocks(self, seq: Sequence, num_gpu_hits: int) -> tuple[int, int]:
        """(CPU, remote) tier blocks that continue ``seq``'s ``num_gpu_hits`` GPU hits
        (shared blocks only; the last token is always left to compute)."""
        tiers = self.tiers
        if tiers is None or not self.enable_prefix_caching:
            return 0, 0
        end = self._num_shared(seq, (seq.num_tokens - 1) // self.block_size)
        if num_gpu_hits >= end:
            return 0, 0
        return tiers.lookup(seq.block_hashes, num_gpu_hits, end)

    def load_from_tiers(self, seq: Sequence, num_gpu_hits: int, num_blocks: int) -> float:
        """Take ``num_blocks`` tier blocks after ``seq``'s GPU hits out of the tiers (call
        before allocating them) and count the lookup; returns the load seconds."""
        tiers = self.tiers
        if tiers is None:
            return 0.0
        tiers.num_queries_tokens += seq.num_tokens
        if not num_blocks:
            return 0.0
        return tiers.load(seq.block_hashes, num_gpu_hits, num_blocks)

    def can_allocate(
        self, cached_block_ids: list[int], num_new_tokens: int, seq: Sequence | None = None
    ) -> bool:
        """Room for a waiting sequence: its cache hits plus ``num_new_tokens`` after them
        (``seq``, whose hits these are, is needed when it has private blocks)."""
        num_hits = len(cached_block_ids)
        num_new_blocks = self.num_blocks_for(num_hits * self.block_size + num_new_tokens)
        num_new_blocks -= num_hits
        num_shared = num_hits if seq is None else self._num_shared(seq, num_hits)
        ref_counts = self._ref_counts
        num_free_hits = num_hits - num_shared  # private hits are free segment blocks
        num_free_hits += sum(1 for b in cached_block_ids[:num_shared] if ref_counts[b] == 0)
        return num_new_blocks + num_free_hits <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int) -> None:
        """Admit ``seq``: take its cache hits, count the query, add blocks for new tokens."""
        num_shared = self._num_shared(seq, len(cached_block_ids))
        for block_id in cached_block_ids[:num_shared]:
            self._take_cached(block_id)
        if num_shared < len(cached_block_ids):
            self._take_segment(seq, len(cached_block_ids) - num_shared)
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

    def _take_segment(self, seq: Sequence, num_blocks: int) -> None:
        """Take the first ``num_blocks`` (in table order) of ``seq``'s free segment."""
        key = seq.free_segment_key
        segment = self._segments[key]
        del segment[len(segment) - num_blocks :]
        self._num_segment_blocks -= num_blocks
        if not segment:
            del self._segments[key]  # its LRU entry is dead now
            seq.free_segment_key = 0

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

    def take_free_blocks(self, num_blocks: int, is_private: bool = False) -> list[int]:
        """``num_blocks`` free blocks, as that many ``append_block`` calls would take
        them (for fused decode steps that register nothing in between); private ones
        (all at private positions) get no reference count."""
        if num_blocks == 1:
            return [self._take_free()]
        return self._take_free_blocks(num_blocks, 0 if is_private else None)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache every full block among the first ``num_tokens`` (computed) tokens
        (private blocks are only counted: nobody else can look them up)."""
        num_full_blocks = num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full_blocks <= seq.num_hashed_blocks:
            return
        begin = seq.num_hashed_blocks
        end = self._num_shared(seq, num_full_blocks)
        if end - begin > 1 and self._register_new_run(seq, begin, end):
            seq.num_hashed_blocks = num_full_blocks
            return
        sink = self.kv_sink
        if sink is not None:
            self._register_reporting(seq, end, sink)
            seq.num_hashed_blocks = num_full_blocks
            return
        hash_to_block, hashes = self._hash_to_block, self._hashes
        block_table, block_hashes = seq.block_table, seq.block_hashes
        for index in range(begin, end):
            block_hash = block_hashes[index]
            if block_hash not in hash_to_block:
                block_id = block_table[index]
                hashes[block_id] = block_hash
                hash_to_block[block_hash] = block_id
        seq.num_hashed_blocks = num_full_blocks

    def _register_new_run(self, seq: Sequence, begin: int, end: int) -> bool:
        """Register blocks ``begin .. end - 1`` of ``seq`` as one run when none of their
        hashes is in the index yet (the common case: a prompt's blocks past its hits);
        False, with nothing changed, when some is (the per-block loop decides then)."""
        # object views: compiled, no int is unboxed and boxed again (a new int object)
        block_hashes = cast("list[object]", seq.block_hashes)
        block_table = cast("list[object]", seq.block_table)
        if len(block_hashes) < end:
            return False
        hash_to_block = cast("dict[object, object]", self._hash_to_block)
        num = len(hash_to_block)
        for index in range(begin, end):  # one lookup per block: setdefault, then a count
            hash_to_block.setdefault(block_hashes[index], block_table[index])
            num += 1
            if len(hash_to_block) != num:  # cached already, or twice in the run: undo
                for undo in range(begin, index):
                    del hash_to_block[block_hashes[undo]]
                return False
        hashes = cast("list[object]", self._hashes)
        for index in range(begin, end):
            hashes[cast("int", block_table[index])] = block_hashes[index]
        if self.kv_sink is not None:
            self.kv_sink.stored(seq, begin, end)
        return True

    def _register_reporting(self, seq: Sequence, end: int, sink: KvEventSink) -> None:
        """``register_full_blocks``' loop up to block ``end``, telling ``sink`` of each
        run of newly registered blocks (a block already in the index ends a run)."""
        hash_to_block, hashes = self._hash_to_block, self._hashes
        block_table, block_hashes = seq.block_table, seq.block_hashes
        begin = -1  # first block of the current run of new blocks (-1: none)
        for index in range(seq.num_hashed_blocks, end):
            block_hash = block_hashes[index]
            if block_hash in hash_to_block:
                if begin >= 0:
                    sink.stored(seq, begin, index)
                    begin = -1
                continue
            block_id = block_table[index]
            hashes[block_id] = block_hash
            hash_to_block[block_hash] = block_id
            if begin < 0:
                begin = index
        if begin >= 0:
            sink.stored(seq, begin, end)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, as vLLM's ``reset_prefix_cache``: only while no
        sequence holds a block (else False, nothing changed). Cached blocks become
        plain free blocks, taken (in their old order) before never-used ones; the KV
        tiers are emptied too (a cold cache)."""
        if self.num_free_blocks < self.num_blocks - 1:
            return False
        self._free_uncached = self.free_block_order()[::-1]
        self._lru.clear()
        self._stale = [0] * len(self._stale)
        self._num_free_cached = 0
        self._segments.clear()
        self._num_segment_blocks = 0
        self._hash_to_block.clear()
        self._hashes = [None] * len(self._hashes)
        if self.kv_sink is not None:
            self.kv_sink.cleared()
        if self.tiers is not None:
            self.tiers.clear()
        return True

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, last block first (so tail blocks are evicted first)."""
        table = seq.block_table
        num_shared = self._num_shared(seq, len(table))
        if num_shared < len(table):
            self._free_private(seq, num_shared)
            table = table[:num_shared]
        ref_counts, hashes = self._ref_counts, self._hashes
        # The ids as the objects they are (compiled, an int read from a list[int] is
        # unboxed, and boxing it again for an append allocates a new int object)
        free_uncached = cast("list[object]", self._free_uncached)
        cached: list[object] = []  # to the LRU's end, in this order
        for item in reversed(cast("list[object]", table)):
            block_id = cast("int", item)
            num_refs = ref_counts[block_id] - 1
            ref_counts[block_id] = num_refs
            if num_refs > 0:
                continue
            if hashes[block_id] is None:
                free_uncached.append(item)
            else:
                cached.append(item)
        if cached:
            cast("deque[object]", self._lru).extend(cached)
            self._num_free_cached += len(cached)
            self._maybe_compact()
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _maybe_compact(self) -> None:
        """Drop the LRU's dead entries once they outnumber the live ones (plus slack), so
        it stays O(free blocks) however many hits take blocks back."""
        if len(self._lru) <= 2 * (self._num_free_cached + len(self._segments)) + self.lru_slack:
            return
        live, stale = self._live_entries(), self._stale
        for key in self._lru:  # a block with dead entries has them here: none is left
            if key >= 0:
                stale[key] = 0
        self._lru = deque(live)

    def _free_private(self, seq: Sequence, begin: int) -> None:
        """Free ``seq``'s private blocks (table from ``begin``), tail first: unregistered
        ones to the uncached list, registered ones as one LRU segment."""
        table = seq.block_table
        end = max(begin, seq.num_hashed_blocks)  # registered: begin .. end - 1
        if end < len(table):
            self._free_uncached += table[end:][::-1]
        if end > begin:
            self._last_segment_key -= 1
            key = self._last_segment_key
            self._segments[key] = table[begin:end][::-1]
            self._lru.append(key)
            self._num_segment_blocks += end - begin
            seq.free_segment_key = key

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        num_blocks = len(seq.block_table)
        num_new_blocks = -(-num_tokens // self.block_size) - num_blocks
        if num_new_blocks == 1:
            seq.block_table.append(self._take_free())
        elif num_new_blocks > 1:
            num_counted = self._num_shared(seq, num_blocks + num_new_blocks) - num_blocks
            seq.block_table += self._take_free_blocks(num_new_blocks, max(0, num_counted))
        self.register_full_blocks(seq, num_tokens)

    def _take_free_blocks(self, num_blocks: int, num_counted: int | None = None) -> list[int]:
        """``num_blocks`` calls of ``_take_free`` in one go (same ids, same order); only
        the first ``num_counted`` (default all: the shared ones) get a reference count."""
        free_uncached, ref_counts = self._free_uncached, self._ref_counts
        num_reused = min(num_blocks, len(free_uncached))
        split = len(free_uncached) - num_reused
        taken = free_uncached[split:][::-1]
        del free_uncached[split:]
        num_fresh = min(num_blocks - num_reused, self._num_fresh_blocks)
        if num_fresh > 0:
            first_id = len(ref_counts)
            taken += _block_ids(first_id, first_id + num_fresh)
            ref_counts += [1] * num_fresh
            self._hashes += [None] * num_fresh
            self._stale += [0] * num_fresh
            self._num_fresh_blocks -= num_fresh
        num_evicted = num_blocks - num_reused - num_fresh
        if num_evicted > 0:
            taken += self._evict(num_evicted)
        if num_counted is None:
            num_counted = num_blocks
        for block_id in taken[:num_counted] if num_counted < num_blocks else taken:
            ref_counts[block_id] = 1
        return taken

    def _take_cached(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:  # free: its LRU entry is dead now
            self._stale[block_id] += 1
            self._num_free_cached -= 1
        self._ref_counts[block_id] += 1

    def _take_free(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.pop()
        elif self._num_fresh_blocks > 0:
            block_id = len(self._ref_counts)
            self._ref_counts.append(0)
            self._hashes.append(None)
            self._stale.append(0)
            self._num_fresh_blocks -= 1
        else:
            block_id = self._evict(1)[0]
        self._ref_counts[block_id] = 1
        return block_id

    def _evict(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` cached free blocks, least recently freed first."""
        lru, segments, stale = self._lru, self._segments, self._stale
        hashes, hash_to_block = self._hashes, self._hash_to_block
        popleft = lru.popleft
        sink, tiers = self.kv_sink, self.tiers
        dropped: list[int] | None = None if sink is None and tiers is None else []
        taken: list[int] = []
        num_shared = 0
        while len(taken) < num_blocks:
            key = popleft()
            if key > 0:  # a shared block: drop its hash
                if stale[key]:  # a dead entry (the block was taken back since)
                    stale[key] -= 1
                    continue
                num_shared += 1
                block_hash = hashes[key]
                if block_hash is not None:
                    del hash_to_block[block_hash]
                    hashes[key] = None
                    if dropped is not None:
                        dropped.append(block_hash)
                taken.append(key)
                continue
            segment = segments.get(key)
            if segment is None:  # a dead entry (the segment was taken back whole)
                continue
            num_wanted = num_blocks - len(taken)
            if len(segment) > num_wanted:  # take its front, leave the rest first in line
                taken += segment[:num_wanted]
                del segment[:num_wanted]
                lru.appendleft(key)
                self._num_segment_blocks -= num_wanted
            else:
                taken += segment
                del segments[key]
                self._num_segment_blocks -= len(segment)
        self._num_free_cached -= num_shared
        if dropped:
            if sink is not None:
                sink.removed(dropped)
            if tiers is not None:
                tiers.offload(dropped)
        return taken
