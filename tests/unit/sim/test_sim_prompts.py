"""Prompt ids derived from request specs keep the workload's prefix structure."""

from __future__ import annotations

import pytest

from kiloserve.sim.prompts import IdPool, PromptIds, run_key
from kiloserve.workload import load_workload, read_trace
from kiloserve.workload.traces import PACKAGED_TRACES_DIR

TRACES = PACKAGED_TRACES_DIR  # shipped with the package


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_run_ids_are_deterministic_prefix_consistent_and_distinct() -> None:
    run_ids = IdPool().run_ids
    assert run_ids("k", 40) == run_ids("k", 40)
    assert run_ids("k", 40)[:10] == run_ids("k", 10)
    assert _common_prefix(run_ids("k", 40), run_ids("j", 40)) == 0
    assert all(0 <= t < 2**32 for t in run_ids("x", 1000))


def test_prefix_groups_share_exactly_their_prefix() -> None:
    spec = "synthetic:input=100,output=4,prefix_groups=2,prefix_tokens=64"
    workload = load_workload(spec, seed=0, rate=5, num_requests=12, with_prompts=False)
    prompts = PromptIds(workload)
    specs = list(workload)
    ids = [prompts.token_ids(s) for s in specs]
    assert all(len(i) == s.input_tokens == 164 for i, s in zip(ids, specs, strict=True))
    for a, sa in zip(ids, specs, strict=True):
        for b, sb in zip(ids, specs, strict=True):
            if a is b:
                continue
            expected = 64 if sa.prefix_group == sb.prefix_group else 0
            assert _common_prefix(a, b) == expected


def test_session_turns_extend_the_previous_prompt() -> None:
    workload = load_workload("sessions:users=2,turns=3", seed=0, rate=5, num_requests=6,
                             with_prompts=False)  # fmt: skip
    prompts = PromptIds(workload)
    last: dict[str, list[int]] = {}
    for spec in workload:
        ids = prompts.token_ids(spec)
        assert len(ids) == spec.input_tokens
        session = spec.session_id or ""
        if session in last:
            assert ids[: len(last[session])] == last[session]
        last[session] = ids


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_mooncake_rows_share_their_hash_id_blocks() -> None:
    workload = load_workload("mooncake", num_requests=300, with_prompts=False, traces_dir=TRACES)
    prompts = PromptIds(workload, TRACES)
    by_group: dict[str, list[int]] = {}
    shared = 0
    for spec in workload:
        ids = prompts.token_ids(spec)
        assert len(ids) == spec.input_tokens
        if spec.prefix_group in by_group and spec.input_tokens >= 512:
            shared += _common_prefix(ids, by_group[spec.prefix_group]) >= 512
        if spec.prefix_group is not None:
            by_group.setdefault(spec.prefix_group, ids)
    assert shared > 0


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_repeated_mooncake_passes_share_blocks_within_a_pass_only() -> None:
    n = 12_031
    workload = load_workload("mooncake:repeat=2", num_requests=n + 2, with_prompts=False,
                             traces_dir=TRACES)  # fmt: skip
    prompts = PromptIds(workload, TRACES)
    specs = list(workload)
    (a0, a1), (b0, b1) = specs[:2], specs[n:]
    ids = {s.request_id: prompts.token_ids(s) for s in (a0, a1, b0, b1)}
    assert b0.request_id == "mooncake-r1-000000"
    assert _common_prefix(ids[a0.request_id], ids[a1.request_id]) >= 512
    assert _common_prefix(ids[b0.request_id], ids[b1.request_id]) >= 512
    assert _common_prefix(ids[a0.request_id], ids[b0.request_id]) == 0


def _mooncake_reference(
    pool: IdPool, hash_ids: tuple[int, ...], num_tokens: int, k: int
) -> tuple[list[int], tuple[int, ...]]:
    """A Mooncake prompt's runs as the module docstring defines them: run ``r`` is
    ``IdPool.run_ids`` of ``m/<hash id>`` (``m/<hash id>/r<k>`` in pass k > 0)."""
    ids: list[int] = []
    keys: list[int] = []
    for h in hash_ids:
        left = num_tokens - len(ids)
        if left <= 0:
            break
        name = f"m/{h}" if k == 0 else f"m/{h}/r{k}"
        keys.append(run_key(name)[0] | run_key(name)[1] << 32)
        ids += pool.run_ids(name, min(512, left))
    return ids, tuple(keys)


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_mooncake_prompts_are_the_runs_of_their_hash_ids() -> None:
    """Cached keys and inlined runs give exactly the ids of the plain definition,
    across passes and for prompts that end inside a run."""
    n = 12_031
    workload = load_workload("mooncake:repeat=3", num_requests=3 * n, with_prompts=False,
                             traces_dir=TRACES)  # fmt: skip
    prompts, pool = PromptIds(workload, TRACES), IdPool()
    rows = [r.hash_ids for r in read_trace("mooncake", TRACES)]
    specs = list(workload)
    picked = specs[:400] + specs[n : n + 200] + specs[2 * n : 2 * n + 200] + specs[:50]
    num_partial = 0
    for spec in picked:
        prompt = prompts.prompt(spec)
        index = int(spec.request_id.rsplit("-", 1)[-1])
        k = int(spec.request_id.split("-r")[1].split("-")[0]) if "-r" in spec.request_id else 0
        ids, keys = _mooncake_reference(pool, rows[index], max(1, spec.input_tokens), k)
        assert prompt.run_keys == keys, spec.request_id
        assert prompt.token_ids[: len(ids)] == ids, spec.request_id
        assert len(prompt.token_ids) == max(1, spec.input_tokens)
        num_partial += len(ids) % 512 != 0
    assert num_partial > 0  # some prompts end inside a run
