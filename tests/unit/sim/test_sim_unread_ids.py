"""Prompts with unread ids (``PromptIds(unread_for=...)``, sim/prompts.py) hash exactly as
prompts with every id: same block hashes (prompt and output blocks), same prefix hashes
for the gateway, same lengths; only ids no ``SimSequence`` reads are ``UNREAD``."""

from __future__ import annotations

import pytest

from kiloserve.sim.prompts import RUN_TOKENS, UNREAD, IdPool, Prompt, PromptIds
from kiloserve.sim.sequence import BLOCK_SIZE, SimSequence
from kiloserve.workload import RequestSpec, load_workload
from kiloserve.workload.traces import PACKAGED_TRACES_DIR

TRACES = PACKAGED_TRACES_DIR


def _sequence(spec: RequestSpec, prompt: Prompt) -> SimSequence:
    """The simulator's sequence for ``prompt`` (sim/simulator.py ``_new_sequence``),
    given output tokens past a few block boundaries so output blocks hash too."""
    seq = SimSequence(
        spec.request_id, prompt.token_ids, 1_000,
        unique_key=None if prompt.unique_from is None else prompt.unique_key,
        unique_from=prompt.unique_from or 0, run_keys=prompt.run_keys,
        run_tokens=prompt.run_tokens, private_from=prompt.private_from,
    )  # fmt: skip
    seq.append_output_tokens(3)
    for _ in range(2 * BLOCK_SIZE + 5):
        seq.append_output_token()
    return seq


def _compare(spec_text: str, num_requests: int, skip: range = range(0)) -> int:
    """Every request (but those ``skip`` numbers) hashed from both prompts alike;
    returns how many ids were unread."""
    workload = load_workload(spec_text, seed=3, rate=10, num_requests=num_requests,
                             with_prompts=False, traces_dir=TRACES)  # fmt: skip
    every = PromptIds(workload, TRACES)
    unread = PromptIds(workload, TRACES, unread_for=BLOCK_SIZE)
    num_unread = 0
    for i, spec in enumerate(workload):
        if i in skip:
            continue
        a, b = every.prompt(spec), unread.prompt(spec)
        assert a._replace(token_ids=[]) == b._replace(token_ids=[]), spec.request_id
        assert len(a.token_ids) == len(b.token_ids) == max(1, spec.input_tokens)
        sa, sb = _sequence(spec, a), _sequence(spec, b)
        assert sa.block_hashes == sb.block_hashes, spec.request_id
        num_blocks = len(a.token_ids) // BLOCK_SIZE
        assert sa.prefix_hashes(num_blocks) == sb.prefix_hashes(num_blocks), spec.request_id
        num_unread += sum(x != y for x, y in zip(a.token_ids, b.token_ids, strict=True))
    return num_unread


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_mooncake_prompts_hash_the_same_with_unread_runs() -> None:
    """Both passes of a repeated trace; most rows end inside their last run, whose ids
    the block after the runs reads (with the output tokens), so it keeps them."""
    n = 12_031  # rows in a pass
    assert _compare("mooncake:repeat=2", n + 300, skip=range(600, n)) > 0


@pytest.mark.parametrize(
    "spec_text",
    [
        "azure-conv",
        "synthetic:input=600,output=20,prefix_groups=4,prefix_tokens=300",
        "synthetic:input=lognormal(300,0.8),output=20",
        "sessions:users=5,turns=4,system_tokens=100",
    ],
)
def test_other_workloads_hash_the_same_with_unread_tails(spec_text: str) -> None:
    num_unread = _compare(spec_text, 300)
    assert (num_unread == 0) == spec_text.startswith("sessions")  # turns keep every id


def test_runs_stay_read_when_the_block_size_does_not_divide_them() -> None:
    workload = load_workload("mooncake", num_requests=50, with_prompts=False, traces_dir=TRACES)
    prompts = PromptIds(workload, TRACES, unread_for=24)  # 512 % 24 != 0: runs are hashed by ids
    for spec in workload:
        prompt = prompts.prompt(spec)
        run_ids = prompt.token_ids[: prompt.run_tokens]
        assert UNREAD not in run_ids[1:], spec.request_id  # pool ids are >= 2^31


@pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")
def test_mooncake_prompt_ids_are_their_runs_then_their_tail() -> None:
    """A Mooncake prompt's list, made at its final length with its read runs written
    into it, holds each run's ``IdPool.hashed_run_ids`` then the unique tail's ids
    (both passes of a repeated trace); with unread ids, every id is that one or
    ``UNREAD``, the whole tail ``UNREAD``."""
    n = 12_031  # rows in a pass
    workload = load_workload("mooncake:repeat=2", seed=3, rate=10, num_requests=n + 300,
                             with_prompts=False, traces_dir=TRACES)  # fmt: skip
    every = PromptIds(workload, TRACES)
    unread = PromptIds(workload, TRACES, unread_for=BLOCK_SIZE)
    pool = IdPool()
    num_partial = 0  # prompts ending inside their last run (its ids are read)
    for i, spec in enumerate(workload):
        if 300 <= i < n:
            continue
        a, b = every.prompt(spec), unread.prompt(spec)
        num_tokens = max(1, spec.input_tokens)
        want: list[int] = []
        for key in a.run_keys:
            want += pool.hashed_run_ids(key, min(RUN_TOKENS, num_tokens - len(want)))
        num_partial += len(want) % RUN_TOKENS > 0
        if len(want) < num_tokens:  # a unique tail (rows whose hash ids fall short)
            assert a.unique_from == len(want), spec.request_id
            want += every.run_ids(f"u/3/{spec.request_id}", num_tokens - len(want))
            assert set(b.token_ids[a.unique_from :]) == {UNREAD}, spec.request_id
        assert a.token_ids == want, spec.request_id
        assert len(b.token_ids) == num_tokens
        assert all(y in (x, UNREAD) for x, y in zip(a.token_ids, b.token_ids, strict=True))
    assert num_partial > 100
