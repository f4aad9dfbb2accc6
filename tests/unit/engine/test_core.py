"""EngineCore: request checks, abort, stats, and advance(k) == k x step()."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from kiloserve.catalog import get_gpu, get_model
from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore, StepResult, StepTimer
from kiloserve.engine.sequence import Sequence, output_token_id
from kiloserve.engine.timing import StepTimeModel
from kiloserve.errors import ConfigError, KiloserveError, RequestError

BS = 4


class LinearTimer:
    """Test double of the step-time model: integer microseconds, summed in closed form."""

    def step_time_s(self, prefill: Seq[tuple[int, int]], decode_contexts: Seq[int]) -> float:
        prefill_us = sum(7 * new + 3 * computed for new, computed in prefill)
        return float(1000 + prefill_us + sum(decode_contexts) + 50 * len(decode_contexts))

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        batch = num_seqs
        per_step = 1000 + context_tokens + 50 * batch
        return float(num_steps * per_step + batch * num_steps * (num_steps - 1) // 2)


def make_core(timer: StepTimer | None = None, **overrides: Any) -> EngineCore:
    values: dict[str, Any] = {
        "num_blocks": 101,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "block_size": BS,
    }
    values.update(overrides)
    return EngineCore(EngineConfig(**values), timer or LinearTimer())


def make_seq(seq_id: str, num_prompt: int, max_tokens: int, base: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(base, base + num_prompt)), max_tokens, block_size=BS)


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "message"),
    [
        (0, 4, "prompt must not be empty"),
        (4, 0, "max_tokens must be at least 1"),
        (200, 57, "maximum context length is 256"),
        (10, 8, "needs 5 KV blocks but the engine has 4"),
    ],
)
def test_add_rejects_requests_that_can_never_run(
    num_prompt: int, max_tokens: int, message: str
) -> None:
    core = make_core(num_blocks=5)
    with pytest.raises(RequestError, match=message):
        core.add(make_seq("r", num_prompt, max_tokens))
    assert not core.has_unfinished()


def test_request_that_exactly_fits_runs_alone_without_preemption() -> None:
    core = make_core(num_blocks=5)
    seq = make_seq("r", 10, 7)  # 16 tokens ever in KV: 4 blocks, all there is
    core.add(seq)
    with pytest.raises(RequestError, match="duplicate"):
        core.add(make_seq("r", 1, 1))
    while core.has_unfinished():
        core.step()
    assert seq.finish_reason == "length" and seq.num_output_tokens == 7
    assert core.num_preemptions_total == 0


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(num_blocks=10, max_num_seqs=64, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ConfigError, match="num_blocks"):
        EngineConfig(num_blocks=1, max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(
            num_blocks=9, max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64, block_size=0
        )


def test_step_results_and_stats() -> None:
    core = make_core(max_num_batched_tokens=8)
    a = Sequence("a", list(range(6)), 2, stop_reason="stop", block_size=BS)
    core.add(a)
    core.add(make_seq("b", 6, 3, base=100))
    assert (core.num_waiting, core.num_running) == (2, 0)
    b = core.get_seq("b")
    first = core.step()
    assert first == StepResult(
        duration_s=1000 + 7 * 8, num_steps=1, new_tokens={"a": 1}, num_prefill_tokens=8,
        started=[a, b],
    )  # fmt: skip
    assert (core.num_waiting, core.num_running, core.num_free_blocks) == (0, 2, 97)
    assert core.kv_usage == pytest.approx(3 / 100)
    second = core.step()  # a decodes over 7 tokens, b prefills 4 over 2
    assert second.duration_s == 1000 + 7 + 50 + 7 * 4 + 3 * 2
    assert second.new_tokens == {"a": 1, "b": 1}
    assert [s.seq_id for s in second.finished] == ["a"]
    assert (second.num_prefill_tokens, second.num_decode_tokens) == (4, 1)
    assert second.started == []  # b left the queue in the first step (a chunk of 2)
    assert a.finish_reason == "stop"
    assert core.get_seq("a") is None and core.get_seq("b") is not None
    assert (core.prefix_cache_queries_tokens, core.prefix_cache_hits_tokens) == (12, 0)
    assert core.num_blocks == 101


def test_idle_step_does_nothing() -> None:
    core = make_core()
    assert core.step() == StepResult(duration_s=0.0, num_steps=0)
    assert core.max_fast_forward_steps() == 0


def test_abort_frees_blocks_now() -> None:
    core = make_core()
    core.add(make_seq("a", 9, 5))
    core.step()
    assert core.num_free_blocks == 97
    seq = core.abort("a")
    assert seq is not None and seq.finish_reason == "abort"
    assert core.num_free_blocks == 100 and not core.has_unfinished()
    assert core.abort("a") is None
    assert core.get_seq("a") is None


def test_max_fast_forward_steps_limits() -> None:
    core = make_core(num_blocks=9, max_num_seqs=2)
    core.add(make_seq("a", 6, 20))
    core.add(make_seq("b", 6, 10, base=100))
    assert core.max_fast_forward_steps() == 0  # prefill pending
    core.step()
    # a: 6 computed, 1 token out; b: 6 computed, 1 out; 4 blocks used, 4 free.
    # b finishes after 9 more steps; blocks last until 8 + 8 = 16 tokens each (14 steps)
    assert core.max_fast_forward_steps() == 9
    core.add(make_seq("c", 3, 1, base=200))  # running is full: c cannot be admitted
    assert core.max_fast_forward_steps() == 9
    with pytest.raises(KiloserveError, match="at most 9"):
        core.advance(10)
    result = core.advance(9)
    assert result.num_steps == 9 and [s.seq_id for s in result.finished] == ["b"]
    assert result.new_tokens == {"a": 9, "b": 9}
    assert core.max_fast_forward_steps() == 0  # c can now be admitted
    assert core.step().new_tokens == {"a": 1, "c": 1}


def test_waiting_head_short_of_blocks_does_not_stop_fast_forward() -> None:
    core = make_core(num_blocks=9, max_num_seqs=4)
    core.add(make_seq("a", 6, 20))
    core.step()
    core.add(make_seq("big", 30, 2, base=100))  # needs 8 blocks, 6 are free
    # a holds 2 blocks; its 19 remaining steps need 5 more (25 tokens), 6 are free
    assert core.max_fast_forward_steps() == 19


def test_fast_forward_steps_within_a_time_budget() -> None:
    core = make_core()
    core.add(make_seq("a", 6, 20))
    core.step()
    # step j (from 0) of the lone decode costs 1000 + (7 + j) + 50 microseconds
    assert core.max_fast_forward_steps() == 19
    assert core.fast_forward_steps_within(1057.0 + 1058.0) == 2
    assert core.fast_forward_steps_within(1057.0 + 1058.0 - 1.0) == 1
    assert core.fast_forward_steps_within(1000.0) == 0
    assert core.fast_forward_steps_within(1e9) == 19


@pytest.mark.parametrize("seed", range(6))
def test_fast_forward_steps_within_equals_a_linear_scan(seed: int) -> None:
    rng = random.Random(seed)
    timer = StepTimeModel(get_gpu(rng.choice(["H100", "A100", "L40S"])), get_model("qwen3-14b"))
    config = EngineConfig(
        num_blocks=2000,
        block_size=BS,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        max_model_len=4096,
    )
    core = EngineCore(config, timer)
    for index in range(rng.randint(1, 40)):
        core.add(
            make_seq(f"s{index}", rng.randint(1, 900), rng.randint(50, 400), base=index * 1000)
        )
    while core.max_fast_forward_steps() == 0:
        core.step()
    max_steps = core.max_fast_forward_steps()
    totals = [core.fast_forward_time_s(k) for k in range(max_steps + 1)]
    budgets = [rng.uniform(0, totals[-1] * 1.2) for _ in range(50)] + totals + [0.0, 1e-12]
    for budget in budgets:
        expected = max(k for k, total in enumerate(totals) if total <= budget)
        assert core.fast_forward_steps_within(budget) == expected, budget


def test_max_fast_forward_steps_stops_before_blocks_run_out() -> None:
    core = make_core(num_blocks=6)  # 5 usable blocks
    core.add(make_seq("a", 6, 12))
    core.add(make_seq("b", 6, 12, base=100))
    core.step()
    # 4 blocks held, 1 free: a takes it at 9 computed tokens (its 3rd step), then b
    # would need one too at its 3rd step
    assert core.max_fast_forward_steps() == 2
    core.advance(2)
    assert core.max_fast_forward_steps() == 0
    result = core.step()
    assert result.num_preempted == 1


def test_waiting_head_that_fits_blocks_fast_forward() -> None:
    core = make_core(max_num_batched_tokens=8)
    core.add(make_seq("a", 4, 10))
    core.step()
    assert core.max_fast_forward_steps() == 9
    core.add(make_seq("b", 20, 2, base=100))
    assert core.max_fast_forward_steps() == 0


def fields(obj: object) -> dict[str, Any]:
    """Every attribute of ``obj``, deep-copied. Under the compiled build (mypyc) classes
    have neither ``__dict__`` nor ``__slots__``; ``__mypyc_attrs__`` names them."""
    cls = type(obj)
    names = getattr(cls, "__mypyc_attrs__", None) or getattr(cls, "__slots__", None)
    return {name: copy.deepcopy(getattr(obj, name)) for name in names or vars(obj)}


def snapshot(core: EngineCore) -> dict[str, Any]:
    sched = core.scheduler
    manager = fields(sched.block_manager)
    if manager.get("tiers") is not None:
        manager["tiers"] = fields(manager["tiers"])  # compared by value, not identity
    return {
        "manager": manager,
        "waiting": [fields(s) for s in sched.waiting],
        "running": [fields(s) for s in sched.running],
        "preemptions": sched.num_preemptions_total,
        "held": {seq_id: fields(seq) for seq_id, seq in sched.held.items()},
        "num_held_blocks": sched.num_held_blocks,
    }


def random_seq(rng: random.Random, index: int, prefixes: list[list[int]]) -> Sequence:
    """A request that may share a prefix with earlier prompts or their outputs."""
    prefix = rng.choice(prefixes)
    prompt = prefix[: rng.randint(1, len(prefix))]
    prompt += [rng.randrange(1000) for _ in range(rng.randint(0, 9))]
    max_tokens = rng.randint(1, 40)
    planned = [rng.randrange(50) for _ in range(max_tokens)] if rng.random() < 0.3 else None
    outputs = planned or [output_token_id(i) for i in range(max_tokens)]
    prefixes.append(prompt + outputs)  # a later prompt may continue this conversation
    return Sequence(
        f"r{index}", prompt, max_tokens, planned_output_token_ids=planned, block_size=BS
    )


def run_pair(
    seed: int, timer: StepTimer | None = None, *, is_pd: bool = False, **extra: Any
) -> tuple[int, int, EngineCore]:
    """Drive a single-stepped and a fast-forwarded engine with the same arrivals
    (``extra``: more engine config, e.g. KV tiers; ``is_pd``: some requests hold their
    blocks on finishing, released later, and some arrive with transferred KV)."""
    rng = random.Random(seed)
    config: dict[str, Any] = {
        "num_blocks": rng.randint(18, 40),
        "max_num_seqs": rng.randint(2, 8),
        "max_num_batched_tokens": rng.choice([8, 16, 64]),
        "long_prefill_token_threshold": rng.choice([0, 0, 5]),
        "enable_prefix_caching": rng.random() < 0.8,
        **extra,
    }
    single, fused = make_core(timer, **config), make_core(timer, **config)
    prefixes = [[rng.randrange(20) for _ in range(24)] for _ in range(3)]
    num_fused_steps = num_added = num_released = 0
    for _ in range(300):
        if rng.random() < 0.15:
            seq = random_seq(rng, num_added, prefixes)
            num_added += 1
            if is_pd:
                kind = rng.random()
                seq.hold_on_finish = kind < 0.3
                if kind > 0.7:
                    seq.num_transferred_tokens = seq.num_prompt_tokens - 1
            try:
                single.add(seq)
            except RequestError:
                continue  # can never fit this config
            fused.add(copy.deepcopy(seq))
        if is_pd and single.scheduler.held and rng.random() < 0.2:
            seq_id = next(iter(single.scheduler.held))
            assert single.release(seq_id) and fused.release(seq_id)
            num_released += 1
        max_steps = fused.max_fast_forward_steps()
        num_steps = rng.randint(1, max_steps) if max_steps else 1
        expected = [single.step() for _ in range(num_steps)]
        got = fused.advance(num_steps) if max_steps else fused.step()
        check_same(expected, got, max_steps > 0, is_exact=timer is None)
        assert snapshot(single) == snapshot(fused)
        num_fused_steps += num_steps if max_steps else 0
    if is_pd:
        assert num_released > 2  # holds really happened and were released
        held = single.scheduler.held.values()
        assert single.num_held_blocks == sum(len(seq.block_table) for seq in held)
    return num_fused_steps, num_added, single


def check_same(expected: list[StepResult], got: StepResult, is_fused: bool, is_exact: bool) -> None:
    if is_fused:
        assert all(r.num_prefill_tokens == 0 and r.num_preempted == 0 for r in expected)
        assert all(not r.finished for r in expected[:-1])
    total_s = sum(r.duration_s for r in expected)
    assert got.duration_s == (total_s if is_exact else pytest.approx(total_s, rel=1e-9))
    tokens: dict[str, int] = {}
    for r in expected:
        for seq_id, n in r.new_tokens.items():
            tokens[seq_id] = tokens.get(seq_id, 0) + n
    assert got.new_tokens == tokens
    assert [s.seq_id for s in got.finished] == [s.seq_id for r in expected for s in r.finished]
    assert got.num_decode_tokens == sum(r.num_decode_tokens for r in expected)
    assert got.num_prefill_tokens == sum(r.num_prefill_tokens for r in expected)


@pytest.mark.parametrize("seed", range(12))
def test_advance_equals_single_steps(seed: int) -> None:
    num_fused_steps, num_added, _ = run_pair(seed)
    assert num_added > 20
    assert num_fused_steps > 50  # fast-forward really happened


@pytest.mark.parametrize("seed", range(6))
def test_advance_equals_single_steps_with_kv_tiers(seed: int) -> None:
    tiers = {
        "kv_cpu_blocks": 6,
        "kv_remote_blocks": 10,
        "kv_bytes_per_block": 1_000_000,
        "kv_cpu_bandwidth_bps": 1e9,  # 1 ms a block (an exact 1000 us with LinearTimer)
        "kv_remote_bandwidth_bps": 1e8,
    }
    num_fused_steps, num_added, core = run_pair(seed, **tiers)
    assert num_added > 20
    assert num_fused_steps > 50
    if core.config.enable_prefix_caching:  # else nothing is hashed, so nothing tiered
        assert core.kv_cpu_hit_tokens > 0 and core.kv_remote_hit_tokens > 0


@pytest.mark.parametrize("seed", range(6))
def test_advance_equals_single_steps_with_held_and_transferred_kv(seed: int) -> None:
    num_fused_steps, num_added, _ = run_pair(seed, is_pd=True)
    assert num_added > 20
    assert num_fused_steps > 50


def test_advance_matches_single_steps_with_the_roofline_timer() -> None:
    timer = StepTimeModel(get_gpu("H100"), get_model("llama-3.1-8b"))
    num_fused_steps, _, _ = run_pair(3, timer)
    assert num_fused_steps > 50


def test_fast_forward_stops_when_a_decode_completes_the_heads_next_cached_block() -> None:
    # 3 usable blocks; s's outputs are planned so a later prompt can extend s's text
    core = make_core(num_blocks=4, max_num_batched_tokens=8)
    s = Sequence(
        "s", list(range(6)), 7, planned_output_token_ids=[90, 91, 92, 93, 94, 95, 96], block_size=BS
    )
    core.add(s)
    core.step()
    head = Sequence("head", [0, 1, 2, 3, 4, 5, 90, 91, 80, 81, 82, 83], 1, block_size=BS)
    core.add(head)
    core.step()  # s decodes; head hits only block 0 and needs 2 blocks, 1 is free
    assert core.num_waiting == 1 and core.num_free_blocks == 1
    # s's block 1 ([4, 5, 90, 91]) is registered next step: then head needs 1 block
    assert core.max_fast_forward_steps() == 0
    result = core.step()
    assert result.num_prefill_tokens == 4 and head.num_cached_tokens == 8
