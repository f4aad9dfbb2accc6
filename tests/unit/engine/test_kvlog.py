"""KV-cache events from the block manager (``kv_sink``) and the twin's ``KvEventLog``.

The hook's calls are checked exactly (runs, splits at blocks already cached, one
removal per eviction, nothing for private blocks); then the end-to-end property: a
gateway index fed only the log's events gives, for any prompt, the match depth the
engine's own prefix cache would hit (block_size 4).
"""

from __future__ import annotations

import random

from conftest import FixedStepTimer
from kiloserve.engine.block_manager import BlockManager
from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore
from kiloserve.engine.kvlog import KvEventLog
from kiloserve.engine.sequence import Sequence, output_token_id
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kiloserve.tokens import prefix_block_hashes

BS = 4
P = list(range(100, 113))  # 13 tokens: blocks A0, A1, A2 and one more token


class Recorder:
    """A ``KvEventSink`` that writes down every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def stored(self, seq: Sequence, begin: int, end: int) -> None:
        self.calls.append(("stored", seq.seq_id, begin, end))

    def removed(self, block_hashes: list[int]) -> None:
        self.calls.append(("removed", list(block_hashes)))

    def cleared(self) -> None:
        self.calls.append(("cleared",))


def seq_of(seq_id: str, prompt: list[int], **kwargs: int) -> Sequence:
    return Sequence(seq_id, prompt, 4, block_size=BS, **kwargs)


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> None:
    """Admit ``seq`` with its cache hits and ``num_new`` tokens (default: all the rest)."""
    hits = bm.find_cached_blocks(seq)
    if num_new is None:
        num_new = seq.num_tokens - len(hits) * BS
    assert bm.can_allocate(hits, num_new, seq)
    bm.allocate(seq, hits, num_new)


def test_stored_runs_split_at_cached_blocks_and_evictions_are_reported() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    rec = Recorder()
    bm.kv_sink = rec
    b = seq_of("b", P)
    admit(bm, b, 4)  # first chunk: A0
    c = seq_of("c", [*P[:8], 300])
    admit(bm, c)  # hits A0, registers A1
    b.num_computed_tokens = 4
    bm.may_append(b, 9)  # A1 is cached already (c's): only A2 is new
    bm.deallocate(c)  # c's A1 block is now free and cached
    d = seq_of("d", list(range(400, 415)))
    admit(bm, d)  # 4 blocks: uncached, 2 fresh, then evicts A1
    bm.deallocate(d)
    a = seq_of("a", [*P[:12], *range(200, 205)])
    admit(bm, a)  # hits A0; A1 new, A2 cached (b's), A3 new; evicts d's 3 blocks
    hb, hd, ha = b.block_hashes, d.block_hashes, a.block_hashes
    assert rec.calls == [
        ("stored", "b", 0, 1),
        ("stored", "c", 1, 2),
        ("stored", "b", 2, 3),
        ("removed", [hb[1]]),
        ("stored", "d", 0, 3),
        ("removed", [hd[2], hd[1], hd[0]]),
        ("stored", "a", 1, 2),
        ("stored", "a", 3, 4),
    ]
    assert ha[:3] == hb[:3]


def test_decode_blocks_are_reported_one_call_per_registration() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    rec = Recorder()
    bm.kv_sink = rec
    seq = Sequence("s", [1, 2, 3, 4, 5, 6], 8, block_size=BS)
    admit(bm, seq)
    seq.num_computed_tokens = 6
    for _ in range(6):  # decode: each step computes the last token and makes one more
        seq.append_output_token()
        bm.may_append(seq, 1)
        seq.num_computed_tokens += 1
    assert seq.num_computed_tokens == 12
    assert rec.calls == [("stored", "s", 0, 1), ("stored", "s", 1, 2), ("stored", "s", 2, 3)]


def test_private_blocks_are_never_reported() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    rec = Recorder()
    bm.kv_sink = rec
    seq = seq_of("p", P, private_from_block=1)
    admit(bm, seq)
    assert rec.calls == [("stored", "p", 0, 1)]
    assert bm.num_cached_blocks == 1  # held private blocks are not counted ...
    bm.deallocate(seq)
    assert bm.num_cached_blocks == 3  # ... free ones are (a segment, not in the index)
    hog = seq_of("hog", list(range(500, 532)))  # all 8 blocks: evicts every cached one
    admit(bm, hog)
    assert rec.calls[1] == ("removed", [seq.block_hashes[0]])
    assert rec.calls[2:] == [("stored", "hog", 0, 8)]


def test_no_sink_leaves_the_cache_as_with_one() -> None:
    def run(bm: BlockManager) -> tuple[list[int], list[int]]:
        first = seq_of("x", P)
        admit(bm, first)
        bm.deallocate(first)
        hog = seq_of("hog", list(range(500, 530)))
        admit(bm, hog)
        again = seq_of("y", P)
        return bm.find_cached_blocks(again), bm.free_block_order()

    quiet = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    told = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    told.kv_sink = Recorder()
    assert run(quiet) == run(told)


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    rec = Recorder()
    bm.kv_sink = rec
    seq = seq_of("s", P)
    admit(bm, seq)
    assert not bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 3
    bm.deallocate(seq)
    free_before = sorted(bm.free_block_order())
    assert bm.reset_prefix_cache()
    assert rec.calls[-1] == ("cleared",)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_blocks(seq_of("t", P)) == []
    assert sorted(bm.free_block_order()) == free_before
    assert bm.num_free_blocks == 8
    admit(bm, seq_of("u", P))  # blocks are handed out again, and registered anew
    assert rec.calls[-1] == ("stored", "u", 0, 3)


# --- the twin's log ------------------------------------------------------------------


def test_log_events_carry_hashes_parent_and_tokens() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    log = KvEventLog(BS)
    bm.kv_sink = log
    a = seq_of("a", P)
    admit(bm, a)
    b = seq_of("b", [*P[:8], 7, 7, 7, 7, 7])
    admit(bm, b)
    h = a.block_hashes
    assert log.num_pending == 2
    assert log.drain() == [
        BlockStored(tuple(h[:3]), None, tuple(P[:12]), BS, medium="GPU"),
        BlockStored((b.block_hashes[2],), h[1], (7, 7, 7, 7), BS, medium="GPU"),
    ]
    assert log.drain() == []
    bm.deallocate(a)
    bm.deallocate(b)
    admit(bm, seq_of("hog", list(range(500, 532))))
    events = log.drain()
    assert isinstance(events[0], BlockRemoved) and events[0].medium == "GPU"
    assert set(events[0].block_hashes) == {*h[:3], b.block_hashes[2]}
    assert bm.reset_prefix_cache() is False  # hog holds every block
    log.cleared()
    assert log.drain() == [AllBlocksCleared()]


def test_log_output_blocks_carry_the_generated_token_ids() -> None:
    config = EngineConfig(
        num_blocks=20, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64
    )
    core = EngineCore(config, FixedStepTimer(0.01))
    log = KvEventLog(config.block_size)
    core.scheduler.block_manager.kv_sink = log
    seq = Sequence("s", list(range(1, 21)), 30)  # block size 16: prompt + 30 outputs
    core.add(seq)
    stored: list[BlockStored] = []
    while core.has_unfinished():
        core.step()
        stored += [e for e in log.drain() if isinstance(e, BlockStored)]
    # 49 tokens computed (the last output is never fed back): blocks 0, 1 and 2
    all_ids = seq.prompt_token_ids + seq.output_token_ids
    assert [e.block_hashes for e in stored] == [(h,) for h in seq.block_hashes[:3]]
    assert [e.parent_block_hash for e in stored] == [None, *seq.block_hashes[:2]]
    assert sum((e.token_ids for e in stored), ()) == tuple(all_ids[:48])
    assert all_ids[20:48] == [output_token_id(i) for i in range(28)]


def _gateway_depth(index: KvBlockIndex, prompt: list[int]) -> int:
    return index.match_depths(prefix_block_hashes(prompt, BS)).get("e", 0)


def _engine_hits(bm: BlockManager, prompt: list[int]) -> int:
    return len(bm.find_cached_blocks(seq_of("probe", prompt)))


def test_detached_blocks_are_held_until_their_parent_is_stored_again() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    log = KvEventLog(BS)
    bm.kv_sink = log
    index = KvBlockIndex(block_size=BS)
    b = seq_of("b", P)
    admit(bm, b, 4)  # A0
    c = seq_of("c", [*P[:8], 300])
    admit(bm, c)  # hits A0, registers A1
    b.num_computed_tokens = 4
    bm.may_append(b, 4)  # b computes its own copy of A1 (not registered: c's is)
    bm.deallocate(c)
    hog = seq_of("hog", list(range(500, 523)))  # 6 blocks: evicts c's A1
    admit(bm, hog)
    bm.deallocate(hog)
    b.num_computed_tokens = 8
    bm.may_append(b, 5)  # A2 registered under A1, which the cache no longer has
    assert log.num_held_blocks == 1
    index.apply("e", log.drain())
    assert _engine_hits(bm, P) == _gateway_depth(index, P) == 1
    e = seq_of("e", [*P[:8], 500])
    admit(bm, e)  # A1 registered again: b's A2 is reachable, and now in the stream
    events = log.drain()
    assert [ev.block_hashes for ev in events if isinstance(ev, BlockStored)] == [
        (b.block_hashes[1],),
        (b.block_hashes[2],),
    ]
    assert log.num_held_blocks == 0
    index.apply("e", events)
    assert index.counters.orphans == 0
    assert _engine_hits(bm, P) == _gateway_depth(index, P) == 3


def test_held_block_evicted_before_release_is_never_mentioned() -> None:
    bm = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)
    log = KvEventLog(BS)
    bm.kv_sink = log
    b = seq_of("b", P)
    admit(bm, b, 4)
    c = seq_of("c", [*P[:8], 300])
    admit(bm, c)
    b.num_computed_tokens = 4
    bm.may_append(b, 4)
    bm.deallocate(c)
    admit(bm, hog := seq_of("hog", list(range(500, 523))))
    bm.deallocate(hog)
    b.num_computed_tokens = 8
    bm.may_append(b, 5)
    bm.deallocate(b)
    log.drain()
    admit(bm, seq_of("hog2", list(range(600, 632))))  # every block: A2 evicted too
    removed = [h for ev in log.drain() if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert b.block_hashes[2] not in removed
    assert b.block_hashes[0] in removed
    assert log.num_held_blocks == 0


def _run_workload(seed: int) -> tuple[KvBlockIndex, int, int]:
    """Random traffic with shared prefixes and follow-up turns through a small engine;
    after every step the gateway index must agree with the engine on every probe.
    Returns the index, the most blocks ever held back, and the removals seen."""
    rng = random.Random(seed)
    config = EngineConfig(
        num_blocks=24, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64, block_size=BS
    )
    core = EngineCore(config, FixedStepTimer(0.01))
    bm = core.scheduler.block_manager
    log = KvEventLog(BS)
    bm.kv_sink = log
    index = KvBlockIndex(block_size=BS)
    stems = [[rng.randrange(50) for _ in range(n)] for n in (5, 9, 13)]
    probes = [list(s) for s in stems]
    max_held = num_removed = 0
    for step in range(300):
        if rng.random() < 0.5:
            prompt = [
                *rng.choice(probes[-12:]),
                *(rng.randrange(50) for _ in range(rng.randrange(4))),
            ]
            prompt = prompt[-30:]
            seq = Sequence(f"s{step}", prompt, rng.randrange(1, 12), block_size=BS)
            core.add(seq)
            probes.append(prompt)
        result = core.step()
        probes += [s.prompt_token_ids + s.output_token_ids for s in result.finished]
        events: list[Event] = log.drain()
        num_removed += sum(isinstance(e, BlockRemoved) for e in events)
        index.apply("e", events)
        max_held = max(max_held, log.num_held_blocks)
        for prompt in probes[-30:]:
            hits = _engine_hits(bm, prompt)
            depth = _gateway_depth(index, prompt)
            assert min(depth, (len(prompt) - 1) // BS) == hits, (seed, step, prompt)
    return index, max_held, num_removed


def test_gateway_index_matches_engine_hits() -> None:
    held = removed = 0
    for seed in range(8):
        index, max_held, num_removed = _run_workload(seed)
        assert index.counters.orphans == 0
        assert index.counters.stored > 0
        held += max_held
        removed += num_removed
    assert removed > 0  # evictions happened
    assert held > 0  # and the detached case too: the log had to hold blocks back
