"""P/D roles in the engine core: transferred prompt tokens (decode side) and blocks
held after finishing until release (prefill side)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import pytest

from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore
from kiloserve.engine.sequence import Sequence, SequenceStatus
from kiloserve.errors import RequestError

BS = 16


class RecordingTimer:
    """Step time = 1 ms + 1 us per prefilled token; records every step's batch."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[tuple[int, int]], list[int]]] = []

    def step_time_s(self, prefill: Seq[tuple[int, int]], decode_contexts: Seq[int]) -> float:
        self.steps.append((list(prefill), list(decode_contexts)))
        return 1e-3 + 1e-6 * sum(new for new, _ in prefill)

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return 1e-3 * num_steps


def make_core(**overrides: Any) -> tuple[EngineCore, RecordingTimer]:
    values: dict[str, Any] = {
        "num_blocks": 201,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 2048,
        "block_size": BS,
    }
    values.update(overrides)
    timer = RecordingTimer()
    return EngineCore(EngineConfig(**values), timer), timer


def make_seq(seq_id: str, num_prompt: int, max_tokens: int, **kwargs: Any) -> Sequence:
    return Sequence(seq_id, list(range(num_prompt)), max_tokens, block_size=BS, **kwargs)


def test_decode_side_sequence_with_1000_transferred_tokens_prefills_exactly_one() -> None:
    core, timer = make_core()
    core.add(make_seq("d", 1001, 3, num_transferred_tokens=1000))
    result = core.step()
    assert timer.steps[0] == ([(1, 1000)], [])  # one token over 1000 computed
    assert result.num_prefill_tokens == 1
    assert result.new_tokens == {"d": 1}  # the first output token in the first step
    assert result.duration_s == pytest.approx(1e-3 + 1e-6)
    seq = core.get_seq("d")
    assert seq is not None
    assert len(seq.block_table) == 63  # ceil(1001 / 16): blocks for the transferred KV
    assert seq.num_cached_tokens == 0  # not a prefix-cache hit
    assert core.prefix_cache_hits_tokens == 0
    assert core.prefix_cache_queries_tokens == 1001


def test_transferred_tokens_use_no_token_budget() -> None:
    core, timer = make_core(max_num_batched_tokens=16, max_num_seqs=2)
    core.add(make_seq("d", 1001, 2, num_transferred_tokens=1000))
    core.add(Sequence("e", list(range(5000, 5040)), 2, block_size=BS))
    core.step()
    assert timer.steps[0] == ([(1, 1000), (15, 0)], [])  # e gets the other 15 tokens


def test_without_transfer_the_whole_prompt_is_prefilled() -> None:
    core, timer = make_core()
    core.add(make_seq("d", 500, 2))
    core.step()
    assert timer.steps[0] == ([(500, 0)], [])


def test_transferred_tokens_after_local_prefix_hits() -> None:
    core, timer = make_core()
    core.add(make_seq("a", 100, 1))
    core.step()  # a finishes; its 6 full blocks (96 tokens) stay cached
    core.add(make_seq("d", 200, 2, num_transferred_tokens=150))
    core.step()
    assert timer.steps[1] == ([(50, 150)], [])  # hits 96 + 54 transferred, 50 left
    assert core.prefix_cache_hits_tokens == 96
    d = core.get_seq("d")
    assert d is not None and d.num_cached_tokens == 96


def test_a_preempted_decode_side_sequence_recomputes() -> None:
    core, timer = make_core(num_blocks=11, max_model_len=160, enable_prefix_caching=False)
    core.add(make_seq("a", 33, 60))
    core.add(make_seq("d", 64, 40, num_transferred_tokens=63))
    core.step()
    assert timer.steps[0] == ([(33, 0), (1, 63)], [])
    for _ in range(100):
        if core.step().num_preempted:
            break
    d = core.get_seq("d")
    assert d is not None and d.num_preemptions == 1 and d.status is SequenceStatus.WAITING
    num_tokens = d.num_tokens
    for _ in range(100):
        core.step()
        if d.status is SequenceStatus.RUNNING:
            break
    assert (num_tokens, 0) in timer.steps[-1][0]  # the whole sequence again: its KV is gone


@pytest.mark.parametrize("num_transferred", [-1, 100, 101])
def test_transferred_tokens_must_leave_the_last_prompt_token(num_transferred: int) -> None:
    core, _ = make_core()
    with pytest.raises(RequestError, match="num_transferred_tokens must be in"):
        core.add(make_seq("d", 100, 2, num_transferred_tokens=num_transferred))


def test_held_prefill_blocks_stay_counted_until_release() -> None:
    core, _ = make_core()
    total_free = core.num_free_blocks
    core.add(make_seq("p", 100, 1, hold_on_finish=True))
    result = core.step()
    assert [s.seq_id for s in result.finished] == ["p"]
    assert core.num_held_blocks == 7  # ceil(100 / 16)
    assert core.num_held_seqs == 1
    assert core.num_free_blocks == total_free - 7
    held = core.get_held("p")
    assert held is not None and len(held.block_table) == 7
    assert held.finish_reason == "length"
    assert not core.has_unfinished()
    assert core.release("p") is True
    assert core.num_held_blocks == 0
    assert core.num_free_blocks == total_free
    assert core.release("p") is False
    assert core.get_held("p") is None


def test_held_blocks_remain_prefix_cache_hits_while_held() -> None:
    core, timer = make_core()
    core.add(make_seq("p", 100, 1, hold_on_finish=True))
    core.step()
    core.add(make_seq("q", 100, 1))
    core.step()
    assert timer.steps[1] == ([(4, 96)], [])  # shares p's 6 full blocks
    assert core.num_held_blocks == 7


def test_an_aborted_hold_on_finish_sequence_frees_at_once() -> None:
    core, _ = make_core()
    total_free = core.num_free_blocks
    core.add(make_seq("p", 100, 5, hold_on_finish=True))
    core.step()
    core.abort("p")
    assert core.num_held_blocks == 0
    assert core.num_free_blocks == total_free


def test_held_blocks_shrink_what_a_waiting_sequence_can_get() -> None:
    core, _ = make_core(num_blocks=11, max_model_len=160, enable_prefix_caching=False)
    core.add(make_seq("p", 100, 1, hold_on_finish=True))
    core.step()
    core.add(make_seq("q", 60, 1))  # needs 4 blocks, 3 free while p holds 7
    assert core.step().num_steps == 0
    assert core.max_fast_forward_steps() == 0
    core.release("p")
    assert [s.seq_id for s in core.step().finished] == ["q"]


def test_holding_an_id_again_releases_the_older_hold() -> None:
    core, _ = make_core()
    total_free = core.num_free_blocks
    core.add(make_seq("p", 100, 1, hold_on_finish=True))
    core.step()
    core.add(make_seq("p", 40, 1, hold_on_finish=True))
    core.step()
    assert core.num_held_blocks == 3  # only the newer one: ceil(40 / 16)
    core.release("p")
    assert core.num_free_blocks == total_free


def test_hold_survives_a_fused_decode_run() -> None:
    core, _ = make_core()
    core.add(make_seq("p", 30, 20, hold_on_finish=True))
    core.step()
    steps = core.max_fast_forward_steps()
    assert steps == 19
    result = core.advance(steps)
    assert [s.seq_id for s in result.finished] == ["p"]
    assert core.num_held_blocks == 4  # 30 prompt + 19 fed-back tokens: ceil(49 / 16)
    assert core.num_free_blocks == 200 - 4
