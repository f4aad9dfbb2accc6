"""BlockManager's run registration (a run of new blocks entered in the hash index at
once) against the original per-block loop: same index, same block hashes, same
``stored`` reports, on random mixes of shared prefixes, evictions and frees, and on
runs the one-run path must hand back to the loop (a hash already cached, a hash twice
in one run)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from kiloserve.engine.block_manager import BlockManager
from kiloserve.engine.sequence import Sequence

BS = 4
SOURCE = Path(__file__).resolve().parents[3] / "src" / "kiloserve" / "engine" / "block_manager.py"


def _interpreted_block_manager() -> type[BlockManager]:
    """``BlockManager`` run from its source file (a compiled class cannot be
    subclassed by an interpreted one)."""
    spec = importlib.util.spec_from_file_location("_block_manager_runs_reference", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: type[BlockManager] = module.BlockManager
    return cls


class Recorder:
    """A ``KvEventSink`` that records every report."""

    def __init__(self) -> None:
        self.reports: list[tuple[object, ...]] = []

    def stored(self, seq: Sequence, begin: int, end: int) -> None:
        self.reports.append(("stored", seq.seq_id, begin, end))

    def removed(self, block_hashes: list[int]) -> None:
        self.reports.append(("removed", tuple(block_hashes)))

    def cleared(self) -> None:
        self.reports.append(("cleared",))


class PerBlock(_interpreted_block_manager()):  # type: ignore[misc]
    """The reference: ``register_full_blocks`` as the original per-block loop."""

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        num_full_blocks = num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full_blocks <= seq.num_hashed_blocks:
            return
        end = self._num_shared(seq, num_full_blocks)
        begin = -1
        for index in range(seq.num_hashed_blocks, end):
            block_hash = seq.block_hashes[index]
            if block_hash in self._hash_to_block:
                if begin >= 0 and self.kv_sink is not None:
                    self.kv_sink.stored(seq, begin, index)
                begin = -1
                continue
            block_id = seq.block_table[index]
            self._hashes[block_id] = block_hash
            self._hash_to_block[block_hash] = block_id
            if begin < 0:
                begin = index
        if begin >= 0 and self.kv_sink is not None:
            self.kv_sink.stored(seq, begin, end)
        seq.num_hashed_blocks = num_full_blocks


def _state(bm: BlockManager) -> tuple[object, ...]:
    return (
        list(bm._hashes),
        dict(bm._hash_to_block),
        bm.free_block_order(),
        bm.num_free_blocks,
    )


def _run(bm: BlockManager, seed: int) -> list[object]:
    """Random admissions (shared prefixes, chunked prompts), decode steps and frees."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 60))] for _ in range(4)]
    live: list[Sequence] = []
    trace: list[object] = []
    for step in range(150):
        action = rng.random()
        if live and (action < 0.3 or bm.num_free_blocks < 10):
            bm.deallocate(live.pop(rng.randrange(len(live))))
        elif live and action < 0.55:
            seq = rng.choice(live)
            num_new = rng.randint(1, 3 * BS)
            if bm.can_append(seq, num_new):
                seq.append_output_tokens(num_new)
                bm.may_append(seq, num_new)
                seq.num_computed_tokens += num_new
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 20))]
            seq = Sequence(f"s{step}", prompt, 40, block_size=BS)
            hits = bm.find_cached_blocks(seq)
            num_new = seq.num_tokens - len(hits) * BS
            if not bm.can_allocate(hits, num_new):
                continue
            bm.allocate(seq, hits, num_new)
            seq.num_computed_tokens = seq.num_tokens
            live.append(seq)
            trace.append(list(seq.block_table))
        trace.append(_state(bm))
    return trace


def test_run_registration_matches_the_per_block_loop() -> None:
    num_mixed = 0
    for seed in range(40):
        for with_sink in (False, True):
            fast = BlockManager(num_blocks=48, block_size=BS, enable_prefix_caching=True)
            slow = PerBlock(num_blocks=48, block_size=BS, enable_prefix_caching=True)
            fast_sink, slow_sink = Recorder(), Recorder()
            if with_sink:
                fast.kv_sink, slow.kv_sink = fast_sink, slow_sink
            assert _run(fast, seed) == _run(slow, seed)
            assert fast_sink.reports == slow_sink.reports
            num_mixed += any(r[0] == "removed" for r in fast_sink.reports)
    assert num_mixed > 0  # some runs evicted cached blocks


def _duplicate_run(bm: BlockManager) -> Sequence:
    """A sequence whose block 5 has block 2's hash (a collision), allocated at once."""
    seq = Sequence("dup", list(range(8 * BS + 1)), 4, block_size=BS)
    seq.block_hashes[5] = seq.block_hashes[2]
    bm.allocate(seq, [], seq.num_tokens)
    return seq


def test_a_hash_twice_in_one_run_is_registered_once() -> None:
    for bm in (
        BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=True),
        PerBlock(num_blocks=40, block_size=BS, enable_prefix_caching=True),
    ):
        sink = Recorder()
        bm.kv_sink = sink
        seq = _duplicate_run(bm)
        table = seq.block_table
        assert bm._hash_to_block[seq.block_hashes[2]] == table[2]
        assert bm._hashes[table[5]] is None  # the second copy stays unregistered
        assert len(bm._hash_to_block) == 7
        assert sink.reports == [("stored", "dup", 0, 5), ("stored", "dup", 6, 8)]


def test_a_run_with_a_cached_hash_reports_the_runs_around_it() -> None:
    bm = BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=True)
    sink = Recorder()
    bm.kv_sink = sink
    first = Sequence("a", list(range(8 * BS + 1)), 4, block_size=BS)
    bm.allocate(first, [], first.num_tokens)
    second = Sequence("b", list(range(8 * BS + 1)), 4, block_size=BS)
    second.block_hashes[:3] = [11, 12, 13]  # blocks 0-2 new, 3-7 the first's hashes
    bm.allocate(second, [], second.num_tokens)
    assert sink.reports == [("stored", "a", 0, 8), ("stored", "b", 0, 3)]
    assert [bm._hashes[b] for b in second.block_table[:3]] == [11, 12, 13]
    assert all(bm._hashes[b] is None for b in second.block_table[3:])
