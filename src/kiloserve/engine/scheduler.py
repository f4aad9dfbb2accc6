"""Continuous batching with chunked prefill and preemption, like vLLM v1's scheduler.

Each step first serves running sequences in admission order: a decode needs one
token, a sequence still in (chunked) prefill gets its next chunk. When one needs a
block and none is free, the most recently admitted running sequence is preempted:
its blocks are freed, it goes to the front of the waiting queue and is recomputed
later. If nothing was preempted, waiting sequences are then admitted first come
first served while ``max_num_seqs`` and the token budget allow; a prefix-cache hit
skips the cached tokens (the last token is always computed).

``schedule`` picks the work; ``postprocess`` applies its result: computed tokens
advance, a sequence whose tokens are all computed gets one output token (so the step
that finishes a prefill yields the first token) and finishes at ``max_tokens``.

Disaggregation (see ``Sequence``): a waiting sequence's ``num_transferred_tokens``
past its prefix-cache hits are allocated and counted as computed when it is first
admitted (they use no token budget); a finished ``hold_on_finish`` sequence keeps its
blocks in ``held`` until ``release``. With KV tiers, an admission's prefix lookup goes
on past the GPU hits into the tiers (unless transferred tokens cover it): the blocks
found are loaded (``batch.load_s``) and counted as computed, like transferred ones.

``max_decode_steps`` / ``advance_decodes`` fuse a run of steps in which the batch only
decodes (no admission, no finish before the last step, enough free blocks); they
reproduce the block allocations and cache registrations of single steps in order.
"""

from __future__ import annotations

from collections import deque

from kiloserve.engine.block_manager import BlockManager
from kiloserve.engine.config import EngineConfig
from kiloserve.engine.kv_tiers import KvTiers
from kiloserve.engine.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler"]

_ALLOCATE = 0
_REGISTER = 1


class ScheduledBatch:
    """One step's work: ``(sequence, number of tokens to compute)`` in schedule order;
    ``started``: the sequences scheduled for the first time (they leave the waiting
    queue: vLLM's queue time ends here); ``load_s``: seconds spent loading KV-tier
    blocks for the sequences admitted. A plain class: see ``StepResult``."""

    __slots__ = ("load_s", "num_new_tokens", "num_preempted", "seqs", "started")

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.num_new_tokens: list[int] = []
        self.num_preempted = 0
        self.started: list[Sequence] = []
        self.load_s = 0.0

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Owns the waiting queue, the running list and the block manager."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        if config.has_kv_tiers:
            self.block_manager.tiers = KvTiers(
                config.kv_cpu_blocks,
                config.kv_remote_blocks,
                config.kv_bytes_per_block,
                config.block_size,
                config.kv_cpu_bandwidth_bps,
                config.kv_remote_bandwidth_bps,
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions_total = 0
        self.held: dict[str, Sequence] = {}  # finished, blocks kept (hold_on_finish)
        self.num_held_blocks = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        token_budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if batch.num_preempted == 0:
            self._schedule_waiting(batch, token_budget)
        return batch

    def _chunk(self, num_tokens: int, token_budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_tokens:
            num_tokens = threshold
        return min(num_tokens, token_budget)

    def _schedule_running(self, batch: ScheduledBatch, token_budget: int) -> int:
        manager = self.block_manager
        size = self.config.block_size
        running = self.running
        index = 0
        while index < len(running) and token_budget > 0:
            seq = running[index]
            computed = seq.num_computed_tokens
            num_new = seq.num_tokens - computed
            if num_new == 1 and computed < len(seq.block_table) * size:
                # fast path (decodes): one token that fits the last block
                if (computed + 1) % size == 0:
                    manager.register_full_blocks(seq, computed + 1)
            else:
                num_new = self._chunk(num_new, token_budget)
                if not self._make_room(seq, num_new, batch):
                    break  # seq itself was preempted; everything after it is gone too
                manager.may_append(seq, num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            token_budget -= num_new
            index += 1
        return token_budget

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt from the back of ``running`` until ``seq`` fits; False if seq went."""
        while not self.block_manager.can_append(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, batch: ScheduledBatch, token_budget: int) -> None:
        manager = self.block_manager
        size = self.config.block_size
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached_block_ids = manager.find_cached_blocks(seq)
            num_hits = len(cached_block_ids)
            num_hit_tokens = num_hits * size
            # tokens past the GPU hits that need blocks but no compute: KV transferred
            # from a prefill engine, or blocks loaded back from a KV tier
            num_external = 0
            num_tier_blocks = -1  # -1: no tier lookup
            if seq.num_transferred_tokens > num_hit_tokens and seq.num_preemptions == 0:
                num_external = seq.num_transferred_tokens - num_hit_tokens
            elif manager.tiers is not None:
                num_cpu, num_remote = manager.find_tier_blocks(seq, num_hits)
                num_tier_blocks = num_cpu + num_remote
                num_external = num_tier_blocks * size
            num_computed = num_hit_tokens + num_external
            num_new = self._chunk(seq.num_tokens - num_computed, token_budget)
            if not manager.can_allocate(cached_block_ids, num_external + num_new, seq):
                break
            self.waiting.popleft()
            if num_tier_blocks >= 0:  # out of the tiers before allocating evicts into them
                batch.load_s += manager.load_from_tiers(seq, num_hits, num_tier_blocks)
            else:
                num_tier_blocks = 0
            manager.allocate(seq, cached_block_ids, num_external + num_new)
            seq.num_computed_tokens = num_computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit_tokens + num_tier_blocks * size
                batch.started.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            token_budget -= num_new

    def postprocess(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance computed tokens, emit output tokens; return the sequences that finished."""
        finished: list[Sequence] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            computed = seq.num_computed_tokens + num_new
            seq.num_computed_tokens = computed
            if computed < seq.num_tokens:
                continue  # mid-prefill chunk: no token yet
            seq.append_output_token()
            if seq.num_output_tokens == seq.max_tokens:
                finished.append(seq)
        self.finish(finished, None)
        return finished

    def finish(self, seqs: list[Sequence], reason: str | None) -> None:
        """Retire running ``seqs`` (reason None = their own ``stop_reason``)."""
        if not seqs:
            return
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.stop_reason if reason is None else reason
            if seq.hold_on_finish and reason is None:
                self._hold(seq)
            else:
                self.block_manager.deallocate(seq)
        done = {id(seq) for seq in seqs}
        self.running = [seq for seq in self.running if id(seq) not in done]

    def _hold(self, seq: Sequence) -> None:
        """Keep a finished ``seq``'s blocks until ``release`` (a sequence held under the
        same id before is released first: its blocks cannot be reached any more)."""
        self.release(seq.seq_id)
        self.held[seq.seq_id] = seq
        self.num_held_blocks += len(seq.block_table)

    def release(self, seq_id: str) -> Sequence | None:
        """Free the blocks of the held sequence ``seq_id`` (None: no such sequence)."""
        seq = self.held.pop(seq_id, None)
        if seq is not None:
            self.num_held_blocks -= len(seq.block_table)
            self.block_manager.deallocate(seq)
        return seq

    def max_decode_steps(self) -> int:
        """Largest k such that the next k steps are pure decodes of the running batch.

        Within those k steps no sequence finishes before step k, no waiting sequence
        can be admitted and the batch needs no more blocks than are free now.
        """
        running = self.running
        if not running or len(running) > self.config.max_num_batched_tokens:
            return 0
        max_steps = -1
        for seq in running:
            num_output = seq.num_output_tokens
            if not num_output or seq.num_computed_tokens != seq.num_tokens - 1:
                return 0  # not decoding (seq.is_decoding, inlined)
            num_remaining = seq.max_tokens - num_output
            if max_steps < 0 or num_remaining < max_steps:
                max_steps = num_remaining
        if self._may_admit_during_decodes():
            return 0
        return self._max_steps_within_free_blocks(max_steps)

    def _max_steps_within_free_blocks(self, max_steps: int) -> int:
        num_free = self.block_manager.num_free_blocks
        size = self.config.block_size
        # tokens each sequence can still add before it needs a new block
        slacks = [len(seq.block_table) * size - seq.num_computed_tokens for seq in self.running]
        if _num_blocks_past(slacks, max_steps, size) <= num_free:
            return max_steps  # the common case: one pass (the search would end here too)
        low, high = 0, max_steps
        while low < high:
            mid = (low + high + 1) // 2
            if _num_blocks_past(slacks, mid, size) <= num_free:
                low = mid
            else:
                high = mid - 1
        return low

    def _may_admit_during_decodes(self) -> bool:
        """Whether the waiting head could be admitted while the batch only decodes.

        Decodes only shrink the free pool and the head's cache hits (by eviction), so a
        lower bound on the blocks the head needs, above the free blocks now, keeps it
        out; unless a running sequence could register the head's next missing block.
        """
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        token_budget = self.config.max_num_batched_tokens - len(self.running)
        if token_budget <= 0:
            return False
        head = self.waiting[0]
        num_hit_blocks = len(self.block_manager.find_cached_blocks(head))
        num_new = self._chunk(
            head.num_tokens - num_hit_blocks * self.config.block_size, token_budget
        )
        if self.block_manager.num_blocks_for(num_new) <= self.block_manager.num_free_blocks:
            return True
        return self._may_gain_hits(head, num_hit_blocks)

    def _may_gain_hits(self, head: Sequence, num_hit_blocks: int) -> bool:
        """Whether a running sequence may yet register the head's next missing block.

        Equal chained hashes mean equal prefixes, so only a sequence sharing the head's
        first ``num_hit_blocks`` blocks, with that block not yet registered, can do it.
        """
        if not self.config.enable_prefix_caching:
            return False
        if num_hit_blocks >= (head.num_tokens - 1) // self.config.block_size:
            return False
        private = head.private_from_block
        if private is not None and num_hit_blocks >= private:
            return False  # the head's own text: nobody else computes it
        wanted = head.block_hashes[num_hit_blocks]
        for seq in self.running:
            hashes = seq.block_hashes
            if seq.num_hashed_blocks > num_hit_blocks or len(hashes) < num_hit_blocks:
                continue
            private = seq.private_from_block
            if private is not None and private <= num_hit_blocks:
                continue  # its block there holds text of its own: never the head's
            if len(hashes) > num_hit_blocks:  # block full of tokens, not yet computed
                if hashes[num_hit_blocks] == wanted:
                    return True
            elif num_hit_blocks == 0 or hashes[-1] == head.block_hashes[num_hit_blocks - 1]:
                return True
        return False

    def advance_decodes(self, num_steps: int) -> list[Sequence]:
        """Apply ``num_steps`` decode steps at once (``num_steps <= max_decode_steps()``).

        Blocks are added and registered in the order single steps would do it (by step,
        then batch position), so the cache ends in exactly the same state. When no
        shared block gets registered on the way (private blocks only count), the new
        blocks are taken in one go and handed out in that order.
        """
        seqs = self.running  # finish() rebinds self.running, never mutates this list
        size = self.config.block_size
        is_caching = self.config.enable_prefix_caching
        finished: list[Sequence] = []
        allocations: list[tuple[int, int]] = []  # (step, index)
        registrations: list[tuple[int, int, int]] = []  # (step, index, computed tokens)
        is_all_private = True  # every new block at a private position (no ref counts)
        for index, seq in enumerate(seqs):
            if seq.max_tokens - seq.num_output_tokens == num_steps:
                finished.append(seq)
            seq.append_output_tokens(num_steps)  # hashes must exist before registering
            computed = seq.num_computed_tokens
            first_step = len(seq.block_table) * size - computed + 1
            if first_step <= num_steps:
                # while loops, not range(..., size): compiled, a range with a variable step
                # is a generic Python object (docs/simulator.md, "Compiled build")
                step = first_step
                while step <= num_steps:
                    allocations.append((step, index))
                    step += size
                private = seq.private_from_block
                is_all_private = is_all_private and private is not None
                is_all_private = is_all_private and len(seq.block_table) >= (private or 0)
            first_step = size - computed % size
            if is_caching and first_step <= num_steps:
                private = seq.private_from_block
                if private is not None and seq.num_hashed_blocks >= private:
                    seq.num_hashed_blocks = (computed + num_steps) // size  # counted only
                else:
                    step = first_step
                    while step <= num_steps:
                        registrations.append((step, index, computed + step))
                        step += size
            seq.num_computed_tokens = computed + num_steps
        if registrations:
            self._apply_block_events(seqs, allocations, registrations)
        elif allocations:
            self._hand_out_blocks(seqs, allocations, is_all_private)
        self.finish(finished, None)
        return finished

    def _hand_out_blocks(
        self, seqs: list[Sequence], allocations: list[tuple[int, int]], is_private: bool
    ) -> None:
        """Blocks for decode steps that register nothing: taken at once, in step order."""
        block_ids = self.block_manager.take_free_blocks(len(allocations), is_private)
        if len(seqs) == 1:
            seqs[0].block_table += block_ids
            return
        allocations.sort()
        for (_, index), block_id in zip(allocations, block_ids, strict=True):
            seqs[index].block_table.append(block_id)

    def _apply_block_events(
        self,
        seqs: list[Sequence],
        allocations: list[tuple[int, int]],
        registrations: list[tuple[int, int, int]],
    ) -> None:
        """Allocate and register in single-step order: by step, batch index, then kind."""
        keyed = [(step, index, _ALLOCATE, 0) for step, index in allocations]
        keyed += [(step, index, _REGISTER, tokens) for step, index, tokens in registrations]
        keyed.sort()
        manager = self.block_manager
        for _, index, kind, num_tokens in keyed:
            if kind == _ALLOCATE:
                manager.append_block(seqs[index])
            else:
                manager.register_full_blocks(seqs[index], num_tokens)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is, freeing its blocks now."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        elif seq.status is SequenceStatus.RUNNING:
            self.finish([seq], "abort")


def _num_blocks_past(slacks: list[int], num_steps: int, block_size: int) -> int:
    """Blocks the batch adds over ``num_steps`` decode steps, from each slack (tokens
    left in its last block): ``ceil((computed + n) / size) - len(block_table)``."""
    num_blocks = 0
    for slack in slacks:
        num_blocks += -(-(num_steps - slack) // block_size)
    return num_blocks
