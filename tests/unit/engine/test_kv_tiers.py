"""KV tiers: GPU evictions offloaded to CPU then remote (LRU), prefix hits in a tier
loaded back at bytes / bandwidth inside the step's duration, counters, tiers off."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from kiloserve.engine.config import EngineConfig
from kiloserve.engine.core import EngineCore, StepResult
from kiloserve.engine.kv_tiers import KvTiers
from kiloserve.engine.sequence import Sequence

BS = 16
BYTES_PER_BLOCK = 1_000_000
CPU_BPS = 1e9  # 1 ms a block
REMOTE_BPS = 1e8  # 10 ms a block


class RecordingTimer:
    """Step time = 1 ms + 1 us per prefilled token; records every step's prefill."""

    def __init__(self) -> None:
        self.prefills: list[list[tuple[int, int]]] = []
        self.times_s: list[float] = []

    def step_time_s(self, prefill: Seq[tuple[int, int]], decode_contexts: Seq[int]) -> float:
        self.prefills.append(list(prefill))
        self.times_s.append(1e-3 + 1e-6 * sum(new for new, _ in prefill))
        return self.times_s[-1]

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return 1e-3 * num_steps


def make_core(**overrides: Any) -> tuple[EngineCore, RecordingTimer]:
    values: dict[str, Any] = {
        "num_blocks": 9,  # 8 usable
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "max_model_len": 256,
        "block_size": BS,
        "kv_cpu_blocks": 4,
        "kv_remote_blocks": 8,
        "kv_bytes_per_block": BYTES_PER_BLOCK,
        "kv_cpu_bandwidth_bps": CPU_BPS,
        "kv_remote_bandwidth_bps": REMOTE_BPS,
    }
    values.update(overrides)
    timer = RecordingTimer()
    return EngineCore(EngineConfig(**values), timer), timer


def prompt(base: int, num_tokens: int) -> list[int]:
    return list(range(base, base + num_tokens))


def run(core: EngineCore, seq_id: str, tokens: list[int], max_tokens: int = 1) -> StepResult:
    """Add a request and step until it is done; the step that scheduled it."""
    core.add(Sequence(seq_id, tokens, max_tokens, block_size=BS))
    first = core.step()
    while core.has_unfinished():
        core.step()
    return first


def tiers_of(core: EngineCore) -> KvTiers:
    tiers = core.scheduler.block_manager.tiers
    assert tiers is not None
    return tiers


def test_kv_tiers_lru_order_gpu_to_cpu_to_remote() -> None:
    tiers = KvTiers(2, 2, BYTES_PER_BLOCK, BS, CPU_BPS, REMOTE_BPS)
    tiers.offload([1, 2, 3])
    assert (list(tiers.cpu), list(tiers.remote)) == ([2, 3], [1])
    tiers.offload([4, 5])
    assert (list(tiers.cpu), list(tiers.remote)) == ([4, 5], [2, 3])  # 1 dropped
    assert (tiers.num_cpu_offloaded_blocks, tiers.num_remote_offloaded_blocks) == (5, 3)
    tiers.offload([2])  # back in CPU, out of remote: one tier at a time
    assert (list(tiers.cpu), list(tiers.remote)) == ([5, 2], [3, 4])
    tiers.offload([5])  # already there: most recent again
    assert list(tiers.cpu) == [2, 5]


def test_kv_tiers_lookup_and_load() -> None:
    tiers = KvTiers(2, 2, BYTES_PER_BLOCK, BS, CPU_BPS, REMOTE_BPS)
    tiers.offload([1, 2, 3, 4])  # cpu [3, 4], remote [1, 2]
    assert tiers.lookup([9, 3, 1, 4, 7, 2], 1, 6) == (2, 1)  # 3 cpu, 1 remote, 4 cpu, 7 miss
    assert tiers.lookup([9, 3], 0, 2) == (0, 0)
    load_s = tiers.load([9, 3, 1, 4], 1, 3)
    assert load_s == 2 * BYTES_PER_BLOCK / CPU_BPS + BYTES_PER_BLOCK / REMOTE_BPS
    assert (list(tiers.cpu), list(tiers.remote)) == ([], [2])
    assert (tiers.num_cpu_hit_tokens, tiers.num_remote_hit_tokens) == (32, 16)
    assert tiers.loaded_bytes == 3 * BYTES_PER_BLOCK
    assert tiers.load_s_total == load_s


def test_without_a_cpu_tier_evictions_go_to_remote() -> None:
    tiers = KvTiers(0, 2, BYTES_PER_BLOCK, BS, CPU_BPS, REMOTE_BPS)
    tiers.offload([1, 2, 3])
    assert (list(tiers.cpu), list(tiers.remote)) == ([], [2, 3])
    assert (tiers.num_cpu_offloaded_blocks, tiers.num_remote_offloaded_blocks) == (0, 3)


def test_cpu_tier_hit_of_n_blocks_adds_n_bytes_over_bandwidth() -> None:
    core, timer = make_core()
    run(core, "a", prompt(0, 64))  # 4 blocks, cached on the GPU
    run(core, "b", prompt(1000, 128))  # needs all 8 blocks: a's 4 go to the CPU tier
    tiers = tiers_of(core)
    assert len(tiers.cpu) == 4 and core.kv_cpu_offloaded_blocks == 4
    result = run(core, "c", prompt(0, 64))  # a's prompt again: 3 blocks hit (last token)
    assert timer.prefills[-1] == [(16, 48)]  # 48 tokens loaded, 16 computed
    assert result.load_s == 3 * BYTES_PER_BLOCK / CPU_BPS
    assert result.duration_s == timer.times_s[-1] + result.load_s
    assert core.kv_cpu_hit_tokens == 48
    assert core.kv_remote_hit_tokens == 0
    assert core.kv_loaded_bytes == 3 * BYTES_PER_BLOCK
    assert core.kv_load_s_total == result.load_s
    assert core.prefix_cache_hits_tokens == 0  # GPU prefix-cache hits only
    assert core.kv_tier_queries_tokens == 64 + 128 + 64


def test_eviction_order_sends_a_prefix_head_to_cpu_and_its_tail_to_remote() -> None:
    # Freed blocks are evicted tail first, so the CPU tier keeps a prefix's head.
    core, timer = make_core(kv_cpu_blocks=2)
    run(core, "a", prompt(0, 64))
    run(core, "b", prompt(1000, 128))  # evicts a3, a2, a1, a0: cpu keeps a1, a0
    tiers = tiers_of(core)
    a = Sequence("x", prompt(0, 64), 1, block_size=BS).block_hashes
    assert list(tiers.cpu) == [a[1], a[0]]
    assert list(tiers.remote) == [a[3], a[2]]
    result = run(core, "c", prompt(0, 64))
    assert result.load_s == 2 * BYTES_PER_BLOCK / CPU_BPS + BYTES_PER_BLOCK / REMOTE_BPS
    assert timer.prefills[-1] == [(16, 48)]
    assert (core.kv_cpu_hit_tokens, core.kv_remote_hit_tokens) == (32, 16)


def test_tier_hits_continue_gpu_hits_and_count_as_cached() -> None:
    core, timer = make_core()
    run(core, "a", prompt(0, 64))
    run(core, "b", prompt(1000, 96))  # 6 blocks: 4 fresh + evicts a3, a2 (tail first)
    run(core, "p", prompt(0, 20))  # hits a0 on the GPU; its new block evicts a1
    assert core.prefix_cache_hits_tokens == 16
    core.add(Sequence("c", prompt(0, 64), 3, block_size=BS))
    result = core.step()
    assert timer.prefills[-1] == [(16, 48)]  # 1 GPU hit + 2 CPU-tier blocks + 16 new
    assert result.load_s == 2 * BYTES_PER_BLOCK / CPU_BPS
    c = core.get_seq("c")
    assert c is not None and c.num_cached_tokens == 48
    assert core.prefix_cache_hits_tokens == 32  # p's a0, then c's a0


def test_transferred_tokens_skip_the_tier_lookup() -> None:
    core, timer = make_core()
    run(core, "a", prompt(0, 64))
    run(core, "b", prompt(1000, 128))
    core.add(Sequence("d", prompt(0, 64), 2, block_size=BS, num_transferred_tokens=63))
    result = core.step()
    assert timer.prefills[-1] == [(1, 63)]
    assert result.load_s == 0.0
    assert core.kv_cpu_hit_tokens == 0


def test_reset_prefix_cache_empties_the_tiers() -> None:
    core, _ = make_core()
    run(core, "a", prompt(0, 64))
    run(core, "b", prompt(1000, 128))
    assert core.kv_cpu_blocks_used == 4
    assert core.scheduler.block_manager.reset_prefix_cache()
    assert (core.kv_cpu_blocks_used, core.kv_remote_blocks_used) == (0, 0)


def test_counters_are_zero_without_tiers() -> None:
    core, _ = make_core(kv_cpu_blocks=0, kv_remote_blocks=0)
    run(core, "a", prompt(0, 64))
    run(core, "b", prompt(1000, 128))
    result = run(core, "c", prompt(0, 64))
    assert core.scheduler.block_manager.tiers is None
    assert result.load_s == 0.0
    assert (core.kv_cpu_hit_tokens, core.kv_cpu_offloaded_blocks, core.kv_loaded_bytes) == (0, 0, 0)


def random_workload(seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for index in range(40):
        num_prompt = rng.randint(1, 90)
        base = 10_000 * (index + 1)  # unique text: no prefix is ever met again
        seqs.append(Sequence(f"r{index}", prompt(base, num_prompt), rng.randint(1, 30)))
    return seqs


def drive(core: EngineCore, seqs: list[Sequence], seed: int) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    log: list[tuple[Any, ...]] = []
    pending = list(seqs)
    while pending or core.has_unfinished():
        if pending and rng.random() < 0.3:
            core.add(pending.pop(0))
        r = core.step()
        log.append((r.duration_s, r.new_tokens, [s.seq_id for s in r.finished], r.load_s))
    return log


@pytest.mark.parametrize("seed", range(4))
def test_tiers_that_never_hit_change_nothing(seed: int) -> None:
    seqs = random_workload(seed)
    # no preemption (a preempted sequence could hit its own offloaded blocks)
    limits = {"num_blocks": 30, "max_num_seqs": 3, "max_model_len": 128}
    plain, _ = make_core(kv_cpu_blocks=0, kv_remote_blocks=0, **limits)
    tiered, _ = make_core(**limits)
    expected = drive(plain, copy.deepcopy(seqs), seed)
    got = drive(tiered, copy.deepcopy(seqs), seed)
    assert got == expected
    assert tiered.num_preemptions_total == 0
    assert tiered.kv_cpu_offloaded_blocks > 0  # the tiers were used, never hit
