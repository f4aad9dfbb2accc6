"""Synthetic workloads: determinism, lengths, mixtures, prefix groups, sessions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiloserve.errors import ConfigError
from kiloserve.tokens import count_tokens
from kiloserve.workload import load_workload

LOGNORMAL = "synthetic:input=lognormal(1000,0.8),output=lognormal(200,0.8)"


def test_same_seed_same_requests_different_seed_different() -> None:
    a = load_workload(LOGNORMAL, seed=7, num_requests=50, rate=5.0)
    b = load_workload(LOGNORMAL, seed=7, num_requests=50, rate=5.0)
    c = load_workload(LOGNORMAL, seed=8, num_requests=50, rate=5.0)
    assert list(a) == list(b)
    assert list(a) == list(a)  # re-iterable
    assert [s.input_tokens for s in a] != [s.input_tokens for s in c]


def test_arrival_process_does_not_change_lengths() -> None:
    open_loop = load_workload(LOGNORMAL, seed=1, num_requests=30, rate=2.0)
    closed = load_workload(LOGNORMAL, seed=1, num_requests=30)
    assert [s.input_tokens for s in open_loop] == [s.input_tokens for s in closed]
    assert all(s.arrival_s is None for s in closed)


def test_lognormal_mean_and_exact_prompt_lengths() -> None:
    specs = list(load_workload(LOGNORMAL, seed=0, num_requests=2000, with_prompts=False))
    assert np.mean([s.input_tokens for s in specs]) == pytest.approx(1000, rel=0.06)
    assert np.mean([s.output_tokens for s in specs]) == pytest.approx(200, rel=0.06)
    for s in load_workload(LOGNORMAL, seed=0, num_requests=20):
        assert count_tokens(s.prompt) == s.input_tokens


def test_fixed_and_uniform_bounds() -> None:
    spec = "synthetic:input=fixed(128),output=uniform(10,50)"
    specs = list(load_workload(spec, seed=3, num_requests=300))
    assert {s.input_tokens for s in specs} == {128}
    outs = [s.output_tokens for s in specs]
    assert min(outs) >= 10 and max(outs) <= 50 and len(set(outs)) > 20


def test_duration_limits_open_loop_arrivals() -> None:
    w = load_workload(LOGNORMAL, seed=0, duration_s=10.0, rate=20.0, with_prompts=False)
    specs = list(w)
    assert w.num_requests == len(specs)
    assert 150 < len(specs) < 250
    assert all(s.arrival_s is not None and s.arrival_s < 10.0 for s in specs)
    unbounded = load_workload(LOGNORMAL, seed=0, duration_s=10.0)  # closed loop
    assert not unbounded.is_bounded


def test_mixture_weights_and_ids() -> None:
    specs = list(load_workload("mix:chat=0.8,longdoc=0.2", seed=0, num_requests=1000,
                               with_prompts=False))  # fmt: skip
    num_long = sum(s.request_id.startswith("longdoc-") for s in specs)
    assert 150 < num_long < 250
    long_mean = np.mean([s.input_tokens for s in specs if s.request_id.startswith("longdoc")])
    chat_mean = np.mean([s.input_tokens for s in specs if s.request_id.startswith("chat")])
    assert long_mean > 4 * chat_mean


def test_prefix_groups_share_exact_prefix() -> None:
    spec = "synthetic:input=fixed(100),output=fixed(10),prefix_groups=3,prefix_tokens=600"
    specs = list(load_workload(spec, seed=2, num_requests=30))
    assert {s.prefix_group for s in specs} == {"group-0", "group-1", "group-2"}
    by_group: dict[str | None, list[str]] = {}
    for s in specs:
        assert s.input_tokens == 700 and count_tokens(s.prompt) == 700
        by_group.setdefault(s.prefix_group, []).append(s.prompt)
    for prompts in by_group.values():
        heads = {" ".join(p.split(" ")[:600]) for p in prompts}
        assert len(heads) == 1
        assert len({p for p in prompts}) == len(prompts)  # suffixes differ
    heads = {" ".join(v[0].split(" ")[:600]) for v in by_group.values()}
    assert len(heads) == 3


def test_sessions_extend_previous_turn() -> None:
    spec = "sessions:users=3,turns=4,input=fixed(50),output=fixed(20)"
    specs = list(load_workload(spec, seed=0, num_requests=12, rate=10.0))
    by_session: dict[str | None, list[str]] = {}
    for s in specs:
        by_session.setdefault(s.session_id, []).append(s.prompt)
        assert count_tokens(s.prompt) == s.input_tokens
    assert len(by_session) == 3
    for prompts in by_session.values():
        assert [count_tokens(p) for p in prompts] == [50, 120, 190, 260]
        for prev, cur in itertools.pairwise(prompts):
            assert cur.startswith(prev + " ")
    assert {s.user for s in specs} == {"user-0", "user-1", "user-2"}
    times = [s.arrival_s for s in specs]
    assert times == sorted(times)


@pytest.mark.parametrize(
    ("spec", "kwargs"),
    [
        ("synthetic:input=fixed(10)", {"num_requests": 1}),
        ("synthetic:input=fixed(10),output=fixed(1),colour=red", {"num_requests": 1}),
        ("mix:chat=1,poetry=1", {"num_requests": 1}),
        ("sessions:users=0,turns=2", {"num_requests": 1}),
        ("synthetic:input=fixed(10),output=fixed(1)", {"num_requests": 0}),
        ("synthetic:input=fixed(10),output=fixed(1)", {"num_requests": 1, "window": (0, 1)}),
    ],
)
def test_bad_workloads_raise_config_error(spec: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        load_workload(spec, seed=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    [
        "synthetic:input=lognormal(1150,0.8),output=lognormal(250,0.8)",
        "synthetic:input=uniform(64,600),output=uniform(8,80),prefix_groups=4,prefix_tokens=256",
        "azure-conv",
        "mooncake",
    ],
)
def test_lengths_are_the_same_with_and_without_prompt_text(spec: str) -> None:
    # without prompts the lengths are computed, not summed from the text's segments
    lean = load_workload(spec, rate=10, num_requests=200, with_prompts=False).take(200)
    full = load_workload(spec, rate=10, num_requests=200, with_prompts=True).take(200)
    assert [(s.request_id, s.input_tokens, s.output_tokens) for s in lean] == [
        (s.request_id, s.input_tokens, s.output_tokens) for s in full
    ]
    assert all(s.prompt == "" for s in lean) and all(s.prompt for s in full)
