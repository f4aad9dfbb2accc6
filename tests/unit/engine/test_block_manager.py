"""BlockManager: allocation, prefix hits, LRU eviction, kv_usage (block_size 4)."""

from __future__ import annotations

import pytest

from kiloserve.engine.block_manager import BlockManager
from kiloserve.engine.sequence import Sequence, chain_block_hash, output_token_id, output_word
from kiloserve.tokens import block_hashes, tokenize

BS = 4


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, prompt, max_tokens, block_size=BS)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` with its cache hits and all its remaining tokens; return the hits."""
    hits = bm.find_cached_blocks(seq)
    num_new = seq.num_tokens - len(hits) * BS
    assert bm.can_allocate(hits, num_new)
    bm.allocate(seq, hits, num_new)
    return hits


def test_allocate_takes_fresh_blocks_and_deallocate_frees_them() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    seq = make_seq("a", list(range(10)))
    admit(bm, seq)
    assert seq.block_table == [1, 2, 3]  # block 0 is the null block
    assert seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 5
    assert bm.kv_usage == pytest.approx(1 - 5 / 8)
    assert bm.num_cached_blocks == 2  # two full blocks of 10 tokens
    bm.deallocate(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 8
    assert bm.kv_usage == 0.0
    # the partial block (no hash) is reused first, then cached blocks tail-first
    assert bm.free_block_order() == [3, 2, 1]


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    a = make_seq("a", list(range(12)))
    assert admit(bm, a) == []
    b = make_seq("b", [*range(12), 99, 98])
    assert admit(bm, b) == [1, 2, 3]
    assert b.block_table == [1, 2, 3, 4]
    assert b.num_computed_tokens == 12
    assert [bm.ref_count(i) for i in range(1, 5)] == [2, 2, 2, 1]
    assert bm.num_free_blocks == 4
    assert (bm.prefix_cache_queries_tokens, bm.prefix_cache_hits_tokens) == (12 + 14, 12)
    bm.deallocate(a)  # still held by b: nothing is freed
    assert bm.num_free_blocks == 4
    assert [bm.ref_count(i) for i in range(1, 5)] == [1, 1, 1, 1]


def test_full_hit_still_recomputes_the_last_token() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    admit(bm, make_seq("a", list(range(12))))
    same = make_seq("same", list(range(12)))
    assert bm.find_cached_blocks(same) == [1, 2]  # third block holds the last token
    longer = make_seq("longer", list(range(13)))
    assert bm.find_cached_blocks(longer) == [1, 2, 3]


def test_hits_stop_at_first_miss() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    admit(bm, make_seq("a", list(range(12))))
    # same second block contents but a different first block: chained hash misses
    other = make_seq("other", [7, 7, 7, 7, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert bm.find_cached_blocks(other) == []
    diverge = make_seq("div", [0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12])
    assert bm.find_cached_blocks(diverge) == [1]


def test_lru_evicts_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)
    a = make_seq("a", list(range(8)))
    b = make_seq("b", list(range(100, 108)))
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == ([1, 2], [3, 4])
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.free_block_order() == [2, 1, 4, 3]
    c = make_seq("c", list(range(200, 204)))
    admit(bm, c)
    assert c.block_table == [2]  # a's tail block, the least recently freed
    assert bm.find_cached_blocks(make_seq("a2", list(range(9)))) == [1]
    assert bm.find_cached_blocks(make_seq("b2", list(range(100, 109)))) == [3, 4]
    # b2 takes its two hits out of the free list and evicts a's head for its new block
    b2 = make_seq("b2", list(range(100, 109)))
    assert admit(bm, b2) == [3, 4]
    assert b2.block_table == [3, 4, 1]
    assert bm.free_block_order() == []
    assert bm.find_cached_blocks(make_seq("a3", list(range(9)))) == []
    bm.deallocate(b2)
    assert bm.free_block_order() == [1, 4, 3]


def test_cached_but_unreferenced_blocks_count_as_free() -> None:
    bm = BlockManager(num_blocks=11, block_size=BS, enable_prefix_caching=True)
    a = make_seq("a", list(range(16)))
    admit(bm, a)
    assert bm.kv_usage == pytest.approx(0.4)
    bm.deallocate(a)
    assert bm.num_cached_blocks == 4
    assert bm.kv_usage == 0.0
    # a hit on free cached blocks makes them used again
    again = make_seq("again", list(range(17)))
    admit(bm, again)
    assert bm.kv_usage == pytest.approx(0.5)


def test_can_allocate_counts_free_hits_as_consumed() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    admit(bm, make_seq("x", list(range(50, 54))))
    a = make_seq("a", list(range(8)))
    admit(bm, a)
    bm.deallocate(a)  # 2 free blocks, both cached for a's prefix
    assert bm.num_free_blocks == 2
    b = make_seq("b", list(range(10)))
    hits = bm.find_cached_blocks(b)
    assert hits == [2, 3]
    assert not bm.can_allocate(hits, 2)  # 1 new block + 2 free hits > 2 free
    c = make_seq("c", list(range(8)))
    hits = bm.find_cached_blocks(c)
    assert hits == [2]
    assert bm.can_allocate(hits, 4)  # 1 new block + 1 free hit == 2 free
    bm.allocate(c, hits, 4)
    assert c.block_table == [2, 3]
    assert bm.num_free_blocks == 0


def test_can_append_and_may_append() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=False)
    seq = make_seq("a", [1, 2, 3])
    admit(bm, seq)
    seq.num_computed_tokens = 3
    assert bm.can_append(seq, 1)  # 4th token fits the first block
    bm.may_append(seq, 1)
    assert seq.block_table == [1]
    seq.num_computed_tokens = 4
    assert bm.can_append(seq, 4)
    assert not bm.can_append(seq, 5)  # would need a third block
    bm.may_append(seq, 4)
    assert seq.block_table == [1, 2] and bm.num_free_blocks == 0
    assert bm.num_cached_blocks == 0  # caching off: nothing registered
    assert bm.prefix_cache_queries_tokens == 0


def test_output_blocks_hash_like_tokens_block_hashes() -> None:
    seq = Sequence("a", list(range(6)), 20, block_size=BS)
    seq.append_output_tokens(7)
    seq.append_output_tokens(5)
    all_tokens = seq.prompt_token_ids + seq.output_token_ids
    assert seq.block_hashes == block_hashes(all_tokens, BS)
    assert chain_block_hash(0, [0, 1, 2, 3]) == block_hashes([0, 1, 2, 3], BS)[0]
    assert [tokenize(output_word(i))[0] for i in range(60)] == [
        output_token_id(i) for i in range(60)
    ]


@pytest.mark.parametrize("planned", [None, [5, 6, 7], list(range(100, 200))])
def test_fused_output_tokens_equal_single_appends(planned: list[int] | None) -> None:
    one_by_one = Sequence("a", list(range(5)), 130, planned_output_token_ids=planned, block_size=BS)
    fused = Sequence("a", list(range(5)), 130, planned_output_token_ids=planned, block_size=BS)
    for _ in range(130):
        one_by_one.append_output_token()
    fused.append_output_tokens(1)
    fused.append_output_tokens(70)
    fused.append_output_tokens(59)
    assert fused.output_token_ids == one_by_one.output_token_ids
    assert fused.block_hashes == one_by_one.block_hashes
    assert fused.num_tokens == 135 and len(fused.block_hashes) == 135 // BS
    expected_head = planned[:130] if planned else []
    assert fused.output_token_ids[: len(expected_head)] == expected_head
    assert fused.output_token_ids[len(expected_head) :] == [
        output_token_id(i) for i in range(len(expected_head), 130)
    ]
