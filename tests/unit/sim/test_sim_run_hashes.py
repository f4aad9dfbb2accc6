"""Keyed-run block hashes (``SimSequence`` with ``run_keys``) keep the tuple hash's
equality structure: two blocks hash equal exactly when their whole prefixes are equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiloserve.sim.prompts import Prompt, PromptIds
from kiloserve.sim.sequence import RUN_TOKENS, SimSequence
from kiloserve.workload import RequestSpec, load_workload
from kiloserve.workload.prompts import BLOCK_TOKENS
from kiloserve.workload.traces import PACKAGED_TRACES_DIR

TRACES = PACKAGED_TRACES_DIR
MooncakeIds = tuple[list[int], tuple[int, ...], int | None, int]
ROOT = Path(__file__).resolve().parents[3]


def _sequence(prompt: Prompt, *, keyed: bool, num_output: int) -> SimSequence:
    seq = SimSequence(
        "s",
        prompt.token_ids,
        num_output + 1,
        unique_key=None if prompt.unique_from is None else prompt.unique_key,
        unique_from=prompt.unique_from or 0,
        run_keys=prompt.run_keys if keyed else (),
        run_tokens=prompt.run_tokens if keyed else 0,
    )
    seq.append_output_tokens(num_output)  # output blocks chain from the prompt's
    return seq


def test_runs_are_the_trace_blocks() -> None:
    assert RUN_TOKENS == BLOCK_TOKENS == 512


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_keyed_run_hashes_match_exactly_where_token_hashes_match() -> None:
    workload = load_workload("mooncake", num_requests=400, with_prompts=False, traces_dir=TRACES)
    prompts = PromptIds(workload, TRACES)
    old_to_new: dict[int, int] = {}
    new_to_old: dict[int, int] = {}
    num_keyed = num_shared = 0
    for i, spec in enumerate(workload):
        prompt = prompts.prompt(spec)
        num_keyed += bool(prompt.run_keys)
        num_output = 40 + i % 7  # the last prompt block fills with output tokens
        old = _sequence(prompt, keyed=False, num_output=num_output)
        new = _sequence(prompt, keyed=True, num_output=num_output)
        assert len(old.block_hashes) == len(new.block_hashes) > 0
        assert old.prefix_hashes(10_000) != new.prefix_hashes(10_000)  # other values...
        for a, b in zip(old.block_hashes, new.block_hashes, strict=True):
            num_shared += a in old_to_new
            assert old_to_new.setdefault(a, b) == b  # ...but the same equalities
            assert new_to_old.setdefault(b, a) == a
    assert num_keyed == 400
    assert num_shared > 10_000  # the trace's prompts share many blocks


@pytest.mark.parametrize("num_tokens", [512 * 3, 512 * 2 + 300, 512 * 2 + 16, 40])
def test_partial_runs_and_prefixes_share_blocks_with_full_runs(num_tokens: int) -> None:
    keys = (11, 22, 33)
    ids = [t for k in keys for t in range(k * 10_000, k * 10_000 + 512)]
    full = SimSequence("a", ids, 4, run_keys=keys, run_tokens=len(ids))
    part = SimSequence("b", ids[:num_tokens], 4, run_keys=keys, run_tokens=num_tokens)
    assert len(part.block_hashes) == num_tokens // 16
    assert part.block_hashes == full.block_hashes[: num_tokens // 16]
    other = SimSequence("c", ids, 4, run_keys=(11, 99, 33), run_tokens=len(ids))
    assert other.block_hashes[:32] == full.block_hashes[:32]
    assert not set(other.block_hashes[32:]) & set(full.block_hashes)


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_a_mooncake_run_is_the_same_with_and_without_keyed_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: the same summary (prefix hits, routing, latencies) either way."""
    from kiloserve.launch.config import load_cluster_config
    from kiloserve.sim import simulate
    from kiloserve.sim.sweep import without_wall_clock

    cluster = load_cluster_config(ROOT / "examples" / "cluster.yaml")

    def run() -> dict[str, object]:
        workload = load_workload("mooncake", rate=8, num_requests=150, with_prompts=False,
                                 traces_dir=TRACES)  # fmt: skip
        summary = simulate(cluster, workload, "default", traces_dir=TRACES).summary
        assert summary["prefix_cache"]["hits_tokens"] > 0
        return without_wall_clock(summary)

    mooncake_ids = PromptIds._mooncake_ids

    def keyed_shared(self: PromptIds, spec: RequestSpec, n: int) -> MooncakeIds:
        ids, keys, _, num_run_ids = mooncake_ids(self, spec, n)
        return ids, keys, None, num_run_ids  # no private runs (next test)

    def unkeyed(self: PromptIds, spec: RequestSpec, n: int) -> MooncakeIds:
        self._unread_runs = False  # runs without keys are hashed from their ids
        ids, _, _, num_run_ids = mooncake_ids(self, spec, n)
        return ids, (), None, num_run_ids

    monkeypatch.setattr(PromptIds, "_mooncake_ids", keyed_shared)
    keyed = run()
    monkeypatch.setattr(PromptIds, "_mooncake_ids", unkeyed)
    assert run() == keyed


@pytest.mark.parametrize("block_size", [16, 32])
def test_output_block_hashes_are_the_tuple_chain(block_size: int) -> None:
    """Output blocks (their tuples cached by position) hash exactly as the tuple
    chain over the prompt and the output ids, step by step and in fused runs."""
    prompt = list(range(1000, 1000 + 3 * block_size + 5))
    for num_output, step in ((3 * block_size, 1), (700, 7), (700, 64), (2500, 1000)):
        seq = SimSequence("s", list(prompt), num_output + 1, block_size=block_size)
        for done in range(0, num_output, step):
            seq.append_output_tokens(min(step, num_output - done))
        tokens = prompt + seq.output_token_ids
        expected, prev = [], 0
        for begin in range(0, len(tokens) - block_size + 1, block_size):
            prev = hash((prev, tuple(tokens[begin : begin + block_size])))
            expected.append(prev)
        assert seq.block_hashes == expected, (num_output, step)
