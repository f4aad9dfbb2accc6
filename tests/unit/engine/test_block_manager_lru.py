"""The block manager's LRU of free cached blocks (a deque with dead entries skipped)
against an ``OrderedDict`` model of vLLM's free-block queue, built only from what the
manager shows: after every operation the free cached blocks must be in the model's
order, a deallocation must append its newly free cached blocks tail first, and the
blocks an allocation evicts must be the model's oldest (after the ones it hit).

Random prompts over a few shared prefixes on a small cache, so blocks are freed, hit
while free (leaving dead entries), evicted and freed again; some prompts have a private
tail (segments in the same LRU). Run with the default compaction slack and with none
(the deque is rebuilt without its dead entries at nearly every deallocation).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kiloserve.engine.block_manager import BlockManager
from kiloserve.engine.sequence import Sequence

BS = 4


def _cached_order(bm: BlockManager) -> list[int]:
    """Free blocks that still hold their text (shared ones, private segments), in the
    order eviction takes them."""
    uncached = set(bm._free_uncached)
    return [b for b in bm.free_block_order() if b not in uncached]


@pytest.mark.parametrize("slack", [4096, 0])
@pytest.mark.parametrize("seed", range(6))
def test_the_lru_keeps_the_ordered_dict_order(seed: int, slack: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=48, block_size=BS, enable_prefix_caching=True)
    bm.lru_slack = slack
    prefixes = [[rng.randrange(30) for _ in range(rng.randint(8, 40))] for _ in range(5)]
    model: OrderedDict[int, None] = OrderedDict()
    live: list[Sequence] = []
    num_evictions = num_free_hits = num_segments = 0
    for step in range(600):
        if live and (rng.random() < 0.5 or bm.num_free_blocks < 12):
            seq = live.pop(rng.randrange(len(live)))
            table = list(seq.block_table)
            num_private = (
                0
                if seq.private_from_block is None
                else len(table) - min(len(table), seq.private_from_block)
            )
            num_segments += num_private > 0 and seq.num_hashed_blocks > len(table) - num_private
            before = set(_cached_order(bm))
            bm.deallocate(seq)
            after = set(_cached_order(bm))
            assert before <= after
            cut = len(table) - num_private
            # vLLM frees a request's blocks tail first; the private ones go in first
            for block_id in [*reversed(table[cut:]), *reversed(table[:cut])]:
                if block_id in after and block_id not in before:
                    model[block_id] = None
        else:
            head = rng.choice(prefixes)[: rng.randint(4, 40)]
            tail = [100 + rng.randrange(10**6) for _ in range(rng.randint(0, 14))]
            prompt = head + tail
            private = None
            if rng.random() < 0.3:  # the blocks wholly in its own tail are private
                private = -(-len(head) // BS)
            seq = Sequence(f"s{step}", prompt, 4, block_size=BS, private_from_block=private)
            hits = bm.find_cached_blocks(seq)
            num_new = seq.num_tokens - len(hits) * BS
            if not bm.can_allocate(hits, num_new, seq):
                continue
            order_before = list(model)
            bm.allocate(seq, hits, num_new)
            live.append(seq)
            still = set(_cached_order(bm))
            hit_free = [b for b in hits if b in model]
            gone = [b for b in order_before if b not in still and b not in hit_free]
            rest = [b for b in order_before if b not in hit_free]
            assert gone == rest[: len(gone)]  # evicted: the oldest, in order
            num_free_hits += len(hit_free)
            num_evictions += len(gone)
            for block_id in hit_free + gone:
                del model[block_id]
        assert _cached_order(bm) == list(model)
        assert bm.num_free_blocks == len(bm.free_block_order()) + bm._num_fresh_blocks
    assert num_evictions > 50 and num_free_hits > 50  # the paths under test ran
    assert num_segments > 10
    if slack == 0:
        assert len(bm._lru) <= 2 * (bm._num_free_cached + len(bm._segments)) + 1
