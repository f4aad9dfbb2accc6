"""Lengths and gaps drawn in blocks equal, bit for bit, the one-call-per-draw reference;
the batched workload digest equals the line-by-line one.

The synthetic generator and the request-rate arrivals take numpy draws in blocks; the
workloads (and so every simulated result) must not change. The references below are
the per-request numpy calls the generator made before.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiloserve.workload.arrivals import STREAM_ARRIVALS, request_rate_arrivals
from kiloserve.workload.prompts import PromptBuilder
from kiloserve.workload.request import RequestSpec
from kiloserve.workload.spec import parse_dist
from kiloserve.workload.synthetic import (
    STREAM_LENGTHS,
    LengthProfile,
    PrefixGroups,
    sample_tokens,
    synthetic_requests,
)

N = 20_000


def _reference_lengths(profile: LengthProfile, seed: int, n: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng([seed, STREAM_LENGTHS])
    draw = sample_tokens
    return [(draw(profile.input, rng), draw(profile.output, rng)) for _ in range(n)]


@pytest.mark.parametrize(
    ("input_dist", "output_dist"),
    [
        ("lognormal(1150,0.8)", "lognormal(250,0.8)"),
        ("lognormal(8000,0.5)", "fixed(300)"),
        ("normal(500,200)", "lognormal(40,1.5)"),
        ("lognormal(100,0)", "normal(20,0)"),  # zero spread still consumes a draw
        ("fixed(64)", "fixed(8)"),
        ("uniform(16,128)", "lognormal(200,0.8)"),  # uniform: the per-call path
    ],
)
def test_batched_lengths_equal_per_call_draws(input_dist: str, output_dist: str) -> None:
    profile = LengthProfile(parse_dist(input_dist), parse_dist(output_dist))
    specs = synthetic_requests(
        {"req": 1.0}, seed=3, arrivals=itertools.repeat(None), builder=PromptBuilder(),
        profile_table={"req": profile}, with_prompts=False,
    )  # fmt: skip
    got = [(s.input_tokens, s.output_tokens) for s in itertools.islice(specs, N)]
    assert got == _reference_lengths(profile, 3, N)


def test_prefix_groups_keep_the_per_call_path() -> None:
    profile = LengthProfile(parse_dist("lognormal(1000,0.8)"), parse_dist("lognormal(200,0.8)"))
    groups = PrefixGroups(num_groups=4, prefix_tokens=32)
    specs = synthetic_requests(
        {"req": 1.0}, seed=5, arrivals=itertools.repeat(None), builder=PromptBuilder(),
        groups=groups, profile_table={"req": profile}, with_prompts=False,
    )  # fmt: skip
    rng = np.random.default_rng([5, STREAM_LENGTHS])
    for spec in itertools.islice(specs, 2_000):
        body, out = sample_tokens(profile.input, rng), sample_tokens(profile.output, rng)
        group = int(rng.integers(4))
        assert (spec.input_tokens, spec.output_tokens) == (body + 32, out)
        assert spec.prefix_group == f"group-{group}"


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 3.0])
def test_batched_gaps_equal_per_call_draws(burstiness: float) -> None:
    rate, seed = 72.0, 9
    rng = np.random.default_rng([seed, STREAM_ARRIVALS])
    expected, t = [], 0.0
    for _ in range(N):
        expected.append(t)
        t += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
    got = list(itertools.islice(request_rate_arrivals(rate, burstiness, seed=seed), N))
    assert got == expected


def test_workload_digest_equals_the_line_by_line_reference() -> None:
    import hashlib
    import zlib

    from kiloserve.workload import load_workload
    from kiloserve.workload.digest import DIGEST_BATCH, WorkloadDigest

    def reference(specs: list[RequestSpec]) -> str:
        h = hashlib.sha256()
        for s in specs:
            crc = zlib.crc32(s.prompt.encode())
            fields = (s.request_id, repr(s.arrival_s), s.input_tokens, s.output_tokens, crc)
            h.update(("|".join(map(str, fields)) + "\n").encode())
        return h.hexdigest()

    for with_prompts in (True, False):
        n = 2 * DIGEST_BATCH + 7
        specs = load_workload("mix:chat=0.7,short=0.3", seed=2, rate=10.0, num_requests=n,
                              with_prompts=with_prompts).take(n)  # fmt: skip
        digest = WorkloadDigest()
        for i, spec in enumerate(specs):
            digest.add(spec)
            if i == 100:
                assert digest.hexdigest() == reference(specs[:101])  # mid-way reads flush
        assert digest.hexdigest() == reference(specs)
