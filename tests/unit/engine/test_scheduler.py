"""Scheduler: FCFS admission under limits, chunked prefill, preemption (block_size 4)."""

from __future__ import annotations

from kiloserve.engine.config import EngineConfig
from kiloserve.engine.scheduler import Scheduler
from kiloserve.engine.sequence import Sequence, SequenceStatus

BS = 4


def make_scheduler(**overrides: int) -> Scheduler:
    values = {"num_blocks": 101, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    values.update(overrides)
    return Scheduler(EngineConfig(max_model_len=1024, block_size=BS, **values))


def add(
    sched: Scheduler, seq_id: str, num_prompt: int, max_tokens: int = 4, base: int = 0
) -> Sequence:
    seq = Sequence(seq_id, list(range(base, base + num_prompt)), max_tokens, block_size=BS)
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One step; returns what was scheduled as ``(seq_id, tokens)``."""
    batch = sched.schedule()
    plan = [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    sched.postprocess(batch)
    return plan


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(sched, f"r{i}", 5, base=10 * i)
    assert step(sched) == [("r0", 5), ("r1", 5)]
    assert [s.seq_id for s in sched.waiting] == ["r2"]
    assert step(sched) == [("r0", 1), ("r1", 1)]


def test_token_budget_chunks_the_last_admitted_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, "a", 5)
    b = add(sched, "b", 5, base=100)
    add(sched, "c", 5, base=200)
    assert step(sched) == [("a", 5), ("b", 3)]  # c waits: budget spent
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert b.status is SequenceStatus.RUNNING and b.num_computed_tokens == 3
    assert step(sched) == [("a", 1), ("b", 2), ("c", 5)]
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1)]


def test_chunked_prefill_splits_and_first_token_ends_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = add(sched, "long", 20, max_tokens=2)
    assert step(sched) == [("long", 8)]
    assert step(sched) == [("long", 8)]
    assert seq.num_output_tokens == 0
    assert step(sched) == [("long", 4)]
    assert seq.num_output_tokens == 1  # the step that finishes the prefill yields a token
    assert step(sched) == [("long", 1)]
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 100


def test_long_prefill_threshold_caps_each_sequence() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=3)
    add(sched, "a", 7)
    add(sched, "b", 7, base=100)
    assert step(sched) == [("a", 3), ("b", 3)]
    assert step(sched) == [("a", 3), ("b", 3)]
    assert step(sched) == [("a", 1), ("b", 1)]
    assert step(sched) == [("a", 1), ("b", 1)]


def test_prefix_hit_skips_cached_tokens() -> None:
    sched = make_scheduler()
    first = add(sched, "first", 10, max_tokens=1)
    step(sched)
    assert first.finish_reason == "length"
    second = add(sched, "second", 11, max_tokens=1)
    assert step(sched) == [("second", 3)]  # blocks [0:4] and [4:8] were cached
    assert second.num_cached_tokens == 8
    manager = sched.block_manager
    assert (manager.prefix_cache_queries_tokens, manager.prefix_cache_hits_tokens) == (21, 8)


def test_preemption_takes_most_recent_and_recomputes_later() -> None:
    # 4 usable blocks of 4 tokens: two sequences of 4 + 8 tokens cannot both finish
    sched = make_scheduler(num_blocks=5)
    a = add(sched, "a", 4, max_tokens=8)
    b = add(sched, "b", 4, max_tokens=8, base=100)
    assert step(sched) == [("a", 4), ("b", 4)]
    for _ in range(4):
        assert step(sched) == [("a", 1), ("b", 1)]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (8, 8)
    assert sched.block_manager.num_free_blocks == 0
    # a needs a third block: b (admitted last) is preempted, no admission this step
    assert step(sched) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert (b.num_preemptions, sched.num_preemptions_total) == (1, 1)
    assert b.block_table == [] and list(sched.waiting) == [b]
    assert b.num_output_tokens == 5  # kept: they are recomputed, not regenerated
    while a.status is not SequenceStatus.FINISHED:
        assert step(sched) == [("a", 1)]  # b cannot come back while a holds the blocks
    # b's first block is still cached: recompute the other 5 tokens, then decode
    assert step(sched) == [("b", 5)]
    assert b.num_output_tokens == 6 and b.num_cached_tokens == 0
    assert step(sched) == [("b", 1)]
    assert step(sched) == [("b", 1)]
    assert b.finish_reason == "length" and not sched.has_unfinished()


def test_preempted_sequences_return_to_the_front_in_admission_order() -> None:
    # 6 usable blocks; a's prefill chunks of 8 tokens need 2 blocks each
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    a = add(sched, "a", 24, max_tokens=1)
    b = add(sched, "b", 3, max_tokens=4, base=100)
    c = add(sched, "c", 3, max_tokens=4, base=200)
    assert step(sched) == [("a", 8), ("b", 3), ("c", 3)]
    assert step(sched) == [("a", 8), ("b", 1), ("c", 1)]
    assert sched.block_manager.num_free_blocks == 0
    # one victim frees one block; a needs two: both later sequences go, newest first
    assert step(sched) == [("a", 8)]
    assert a.finish_reason == "length"
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]
    assert (b.num_preemptions, c.num_preemptions, sched.num_preemptions_total) == (1, 1, 2)
    # both come back and recompute prompt + the 2 tokens they had produced
    assert step(sched) == [("b", 5), ("c", 5)]
    assert (b.num_output_tokens, c.num_output_tokens) == (3, 3)


def test_abort_frees_blocks_of_running_and_waiting() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a = add(sched, "a", 9)
    b = add(sched, "b", 9, base=100)
    step(sched)
    assert sched.block_manager.num_free_blocks == 97
    sched.abort(a)
    assert a.finish_reason == "abort" and a.block_table == []
    assert sched.block_manager.num_free_blocks == 100
    sched.abort(b)
    assert b.finish_reason == "abort" and not sched.has_unfinished()
