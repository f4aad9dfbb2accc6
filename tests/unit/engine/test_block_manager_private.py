"""Private blocks (``Sequence.private_from_block``): the block manager's speed path for
text no other sequence has must behave exactly like the per-block path.

Three engines get the same random arrivals on a small cache (evictions and
preemptions happen): single steps with private blocks, fast-forwarded runs with private
blocks, and single steps with every block shared (the reference). Step results, block
tables, free counts, eviction order and prefix-cache counters must agree.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore, StepResult
from kiloserve.engine.sequence import Sequence
from kiloserve.errors import RequestError

BS = 4


class UnitTimer:
    def step_time_s(self, prefill: Seq[tuple[int, int]], decode_contexts: Seq[int]) -> float:
        return 1.0

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return float(num_steps)


def make_core(config: dict[str, Any]) -> EngineCore:
    return EngineCore(EngineConfig(block_size=BS, max_model_len=256, **config), UnitTimer())


def observed(core: EngineCore) -> dict[str, Any]:
    sched, manager = core.scheduler, core.scheduler.block_manager
    return {
        "running": [(s.seq_id, list(s.block_table), s.num_computed_tokens) for s in sched.running],
        "waiting": [(s.seq_id, s.num_preemptions) for s in sched.waiting],
        "free": manager.num_free_blocks,
        "order": manager.free_block_order(),
        "queries": manager.prefix_cache_queries_tokens,
        "hits": manager.prefix_cache_hits_tokens,
        "preemptions": sched.num_preemptions_total,
    }


def result_of(r: StepResult) -> tuple[object, ...]:
    finished = [(s.seq_id, s.num_cached_tokens) for s in r.finished]
    return (r.num_steps, r.new_tokens, finished, r.num_preempted, r.num_prefill_tokens)


def new_seq(
    rng: random.Random, index: int, prefixes: list[list[int]]
) -> tuple[Sequence, int | None]:
    """A prompt: a cut of a shared prefix, then (often) text of its own; returns it and
    its first private block (None: all shared)."""
    prefix = rng.choice(prefixes)
    shared = prefix[: rng.randint(1, len(prefix))]
    own = [100_000 + index * 1000 + i for i in range(rng.choice([0, 1, 3, 5, 9, 17]))]
    seq = Sequence(f"r{index}", shared + own, rng.randint(1, 30), block_size=BS)
    if not own:
        prefixes.append(shared)  # all shared text: later prompts may extend it
        return seq, None
    return seq, len(shared) // BS


@pytest.mark.parametrize("seed", range(16))
def test_private_blocks_behave_like_shared_ones(seed: int) -> None:
    rng = random.Random(seed)
    config = {
        "num_blocks": rng.randint(14, 30),
        "max_num_seqs": rng.randint(2, 6),
        "max_num_batched_tokens": rng.choice([8, 16, 64]),
        "long_prefill_token_threshold": rng.choice([0, 0, 5]),
        "enable_prefix_caching": rng.random() < 0.85,
    }
    private, fused, reference = make_core(config), make_core(config), make_core(config)
    prefixes = [[rng.randrange(30) for _ in range(20)] for _ in range(3)]
    num_private = num_fused = 0
    for index in range(300):
        if rng.random() < 0.2:
            seq, private_from = new_seq(rng, index, prefixes)
            try:
                reference.add(seq)
            except RequestError:
                continue
            mine = copy.deepcopy(seq)
            if private_from is not None:
                mine.private_from_block = private_from
                num_private += 1
            private.add(mine)
            fused.add(copy.deepcopy(mine))
        max_steps = fused.max_fast_forward_steps()
        num_steps = rng.randint(1, max_steps) if max_steps else 1
        expected = [reference.step() for _ in range(num_steps)]
        assert [result_of(private.step()) for _ in range(num_steps)] == [
            result_of(r) for r in expected
        ]
        got = fused.advance(num_steps) if max_steps else fused.step()
        assert got.new_tokens == {k: v for r in expected for k, v in r.new_tokens.items()} | {
            k: sum(r.new_tokens.get(k, 0) for r in expected) for k in got.new_tokens
        }
        assert [s.seq_id for s in got.finished] == [s.seq_id for r in expected for s in r.finished]
        assert observed(private) == observed(reference) == observed(fused)
        num_fused += num_steps if max_steps else 0
    assert num_private > 10 and num_fused > 20


def test_a_preempted_sequence_hits_what_is_left_of_its_private_blocks() -> None:
    # 8 usable blocks: "b" runs first, then "a" (private from block 0); when b needs a
    # block and none is free, a (the last admitted) is preempted; its registered
    # blocks wait in the LRU as one segment and a finds them again when re-admitted
    core = make_core({"num_blocks": 9, "max_num_seqs": 2, "max_num_batched_tokens": 64})
    b = Sequence("b", list(range(2000, 2009)), 20, block_size=BS)
    core.add(b)
    core.step()
    a = Sequence("a", list(range(1000, 1013)), 8, block_size=BS, private_from_block=0)
    core.add(a)
    for _ in range(40):
        if a.num_preemptions:
            break
        core.step()
    assert a.num_preemptions == 1 and a.free_segment_key != 0
    manager = core.scheduler.block_manager
    assert manager.num_cached_blocks >= 3  # a's registered prompt blocks, one free segment
    hits = manager.find_cached_blocks(a)
    assert 3 <= len(hits) <= (a.num_tokens - 1) // BS  # its full blocks, none evicted yet
    for _ in range(100):
        if a in core.scheduler.running:
            break
        core.step()
    assert a.block_table[: len(hits)] == hits  # re-admitted onto its own blocks
    for _ in range(100):
        if not core.has_unfinished():
            break
        core.step()
    assert a.finish_reason == "length" and b.finish_reason == "length"
    assert manager.num_free_blocks == 8
