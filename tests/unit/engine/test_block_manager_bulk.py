"""BlockManager's bulk path (taking a prompt's free blocks at once) against a
one-block-at-a-time reference (the original take and free loops), on random mixes of
shared prefixes, evictions and frees."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from kiloserve.engine.block_manager import BlockManager
from kiloserve.engine.sequence import Sequence

BS = 4
SOURCE = Path(__file__).resolve().parents[3] / "src" / "kiloserve" / "engine" / "block_manager.py"


def _interpreted_block_manager() -> type[BlockManager]:
    """``BlockManager`` run from its source file, never compiled: under the compiled
    build (mypyc) an interpreted class cannot subclass the compiled one."""
    spec = importlib.util.spec_from_file_location("_block_manager_reference", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: type[BlockManager] = module.BlockManager
    return cls


class OneAtATime(_interpreted_block_manager()):  # type: ignore[misc]
    """The reference: every block taken and freed singly (the original loops)."""

    def _take_free_blocks(self, num_blocks: int, num_counted: int | None = None) -> list[int]:
        return [self._take_free() for _ in range(num_blocks)]

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            if self._hashes[block_id] is None:
                self._free_uncached.append(block_id)
            else:  # one LRU entry per block
                self._lru.append(block_id)
                self._num_free_cached += 1
        seq.block_table = []
        seq.num_hashed_blocks = 0


def _state(bm: BlockManager) -> tuple[object, ...]:
    return (
        list(bm._ref_counts),
        list(bm._hashes),
        list(bm._free_uncached),
        bm.free_block_order(),
        dict(bm._hash_to_block),
        bm.num_free_blocks,
    )


def _run(bm: BlockManager, seed: int) -> list[object]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 60))] for _ in range(4)]
    live: list[Sequence] = []
    trace: list[object] = []
    for step in range(120):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 8):
            seq = live.pop(rng.randrange(len(live)))
            bm.deallocate(seq)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 20))]
            seq = Sequence(f"s{step}", prompt, 4, block_size=BS)
            hits = bm.find_cached_blocks(seq)
            num_new = seq.num_tokens - len(hits) * BS
            if not bm.can_allocate(hits, num_new):
                continue
            bm.allocate(seq, hits, num_new)
            live.append(seq)
            trace.append(list(seq.block_table))
        trace.append(_state(bm))
    return trace


def test_bulk_take_and_free_match_one_block_at_a_time() -> None:
    num_evicting = 0
    for seed in range(40):
        fast = BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=True)
        slow = OneAtATime(num_blocks=40, block_size=BS, enable_prefix_caching=True)
        assert _run(fast, seed) == _run(slow, seed)
        num_evicting += fast.num_cached_blocks < len(fast._hashes) - 1
    assert num_evicting > 0  # some runs reused or evicted blocks


def test_bulk_paths_without_prefix_caching() -> None:
    for seed in range(10):
        fast = BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=False)
        slow = OneAtATime(num_blocks=40, block_size=BS, enable_prefix_caching=False)
        assert _run(fast, seed) == _run(slow, seed)


def test_bulk_registration_keeps_blocks_already_cached() -> None:
    bm = BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(8 * BS + 1))
    first, second = Sequence("a", prompt, 4, block_size=BS), Sequence("b", prompt, 4, block_size=BS)
    bm.allocate(first, [], first.num_tokens)
    bm.allocate(second, [], second.num_tokens)  # no hits taken: same hashes, new blocks
    for block_hash, block_id in zip(first.block_hashes, first.block_table, strict=False):
        assert bm._hash_to_block[block_hash] == block_id
    assert all(bm._hashes[block_id] is None for block_id in second.block_table)
    assert second.num_hashed_blocks == 8
