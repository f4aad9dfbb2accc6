"""Synthetic workloads: length distributions, named presets, mixtures, shared prefixes.

* ``synthetic:input=DIST,output=DIST`` draws each request's lengths independently.
* ``mix:chat=0.8,longdoc=0.2`` picks a preset per request with those weights (the
  request id names the preset, e.g. ``longdoc-000017``).
* ``prefix_groups=N,prefix_tokens=T`` puts every request in one of N groups chosen
  uniformly; requests of a group start with the same T-token text. Here ``input`` is
  the length of the part *after* the shared prefix, so input_tokens = T + input.

``lognormal(MEAN,SIGMA)`` has arithmetic mean MEAN (mu = ln MEAN - SIGMA^2 / 2);
lengths are rounded and clipped to [1, MAX_TOKENS]. Lengths and group choices come
from ``numpy.random.default_rng([seed, stream])``, arrival times from their own
stream, so changing the arrival process never changes the lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from kiloserve.errors import ConfigError
from kiloserve.workload.prompts import NS_GROUP, NS_UNIQUE, PromptBuilder, Segment, split_tokens
from kiloserve.workload.request import RequestSpec
from kiloserve.workload.spec import Dist, check_keys, int_option, parse_dist

__all__ = [
    "MAX_TOKENS",
    "PRESETS",
    "LengthProfile",
    "PrefixGroups",
    "parse_mix",
    "parse_synthetic",
    "sample_tokens",
    "synthetic_requests",
]

MAX_TOKENS = 1_000_000
STREAM_LENGTHS = 1


@dataclass(frozen=True, slots=True)
class LengthProfile:
    """Input and output length distributions of one request class."""

    input: Dist
    output: Dist


def _profile(input_text: str, output_text: str) -> LengthProfile:
    return LengthProfile(parse_dist(input_text), parse_dist(output_text))


# Named request classes for ``mix:``; shapes follow the shipped traces' means.
PRESETS: Mapping[str, LengthProfile] = MappingProxyType(
    {
        "chat": _profile("lognormal(1000,0.8)", "lognormal(200,0.8)"),
        "longdoc": _profile("lognormal(8000,0.5)", "lognormal(300,0.5)"),
        "code": _profile("lognormal(2000,0.8)", "lognormal(30,0.8)"),
        "summarize": _profile("lognormal(4000,0.6)", "lognormal(150,0.5)"),
        "short": _profile("uniform(16,128)", "uniform(10,50)"),
    }
)


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """``num_groups`` groups whose requests share a ``prefix_tokens``-token prefix."""

    num_groups: int = 0
    prefix_tokens: int = 0

    @property
    def is_enabled(self) -> bool:
        return self.num_groups > 0 and self.prefix_tokens > 0


def sample_tokens(dist: Dist, rng: np.random.Generator) -> int:
    """One length drawn from ``dist``, rounded and clipped to [1, MAX_TOKENS]."""
    p = dist.params
    if dist.kind == "fixed":
        value = p[0]
    elif dist.kind == "uniform":
        value = float(rng.integers(int(p[0]), int(p[1]) + 1))
    elif dist.kind == "lognormal":
        value = float(rng.lognormal(math.log(p[0]) - p[1] ** 2 / 2, p[1]))
    else:
        value = float(rng.normal(p[0], p[1]))
    return _to_tokens(value)


def _to_tokens(value: float) -> int:
    """A drawn length, rounded and clipped to [1, MAX_TOKENS]."""
    return int(min(MAX_TOKENS, max(1, round(value))))


def _normal_draws(rng: np.random.Generator, block: int = 4096) -> Iterator[float]:
    """``rng``'s standard normals, drawn ``block`` at a time: the same values, in the
    same order, as one ``rng.normal``/``rng.lognormal`` call each (numpy computes both
    from one standard normal; tests/unit/workload/test_synthetic_batched.py checks bit equality)."""
    while True:
        yield from rng.standard_normal(block).tolist()


def _via_normals(dist: Dist) -> Callable[[Iterator[float]], int] | None:
    """A sampler equal to ``sample_tokens(dist, rng)`` fed from ``_normal_draws(rng)``,
    or None when ``dist`` draws anything but standard normals (uniform)."""
    p = dist.params
    if dist.kind == "fixed":
        fixed = _to_tokens(p[0])
        return lambda normals: fixed
    if dist.kind == "lognormal":
        mu, sigma = math.log(p[0]) - p[1] ** 2 / 2, p[1]
        return lambda normals: _to_tokens(math.exp(mu + sigma * next(normals)))
    if dist.kind == "normal":
        mean, std = p
        return lambda normals: _to_tokens(mean + std * next(normals))
    return None


def parse_synthetic(options: Mapping[str, str]) -> tuple[LengthProfile, PrefixGroups]:
    """``input``/``output`` distributions and optional prefix groups of a synthetic spec."""
    check_keys("synthetic", options, ("input", "output", "prefix_groups", "prefix_tokens"))
    if "input" not in options or "output" not in options:
        raise ConfigError("synthetic workload needs both input=DIST and output=DIST")
    profile = _profile(options["input"], options["output"])
    return profile, parse_prefix_groups(options)


def parse_prefix_groups(options: Mapping[str, str]) -> PrefixGroups:
    num_groups = int_option(options, "prefix_groups", 0)
    prefix_tokens = int_option(options, "prefix_tokens", 512 if num_groups else 0)
    if (num_groups > 0) != (prefix_tokens > 0):
        raise ConfigError("prefix_groups and prefix_tokens must both be > 0 (or both absent)")
    return PrefixGroups(num_groups, prefix_tokens)


def parse_mix(options: Mapping[str, str]) -> dict[str, float]:
    """Preset name -> normalised weight for a ``mix:`` spec."""
    weights: dict[str, float] = {}
    for name, value in options.items():
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r} in mix; valid: {', '.join(PRESETS)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ConfigError(f"mix weight for {name!r} must be a number, got {value!r}") from None
        if weights[name] < 0:
            raise ConfigError(f"mix weight for {name!r} must be >= 0")
    total = sum(weights.values())
    if total <= 0:
        raise ConfigError("mix weights must add up to more than 0")
    return {name: w / total for name, w in weights.items()}


def synthetic_requests(
    profiles: Mapping[str, float],
    *,
    seed: int,
    arrivals: Iterator[float | None],
    builder: PromptBuilder,
    groups: PrefixGroups = PrefixGroups(),
    profile_table: Mapping[str, LengthProfile] = PRESETS,
    with_prompts: bool = True,
) -> Iterator[RequestSpec]:
    """Endless stream of requests; ``profiles`` maps a class name to its weight."""
    rng = np.random.default_rng([seed, STREAM_LENGTHS])
    names = list(profiles)
    probs = np.array([profiles[n] for n in names], dtype=float)
    # One class, no groups, normal-based lengths: the rng draws nothing but standard
    # normals, so they can come in blocks (the same lengths, far fewer numpy calls).
    draw_in = draw_out = None
    if len(names) == 1 and not groups.is_enabled:
        single = profile_table[names[0]]
        draw_in, draw_out = _via_normals(single.input), _via_normals(single.output)
    normals = _normal_draws(rng)
    for i, arrival_s in enumerate(arrivals):
        name = names[0] if len(names) == 1 else names[int(rng.choice(len(names), p=probs))]
        profile = profile_table[name]
        if draw_in is not None and draw_out is not None:
            body_tokens, output_tokens = draw_in(normals), draw_out(normals)
        else:
            body_tokens = sample_tokens(profile.input, rng)
            output_tokens = sample_tokens(profile.output, rng)
        group = int(rng.integers(groups.num_groups)) if groups.is_enabled else None
        prompt = ""
        if with_prompts:
            prompt = builder.render(_segments(seed, i, body_tokens, group, groups))
        yield RequestSpec(
            request_id=f"{name}-{str(i).zfill(6)}",  # = {i:06d}, without str.format
            arrival_s=arrival_s,
            # what the segments add up to: the group's head, then the body
            input_tokens=body_tokens + (0 if group is None else groups.prefix_tokens),
            output_tokens=output_tokens,
            prompt=prompt,
            prefix_group=None if group is None else f"group-{group}",
        )


def _segments(
    seed: int, index: int, body_tokens: int, group: int | None, groups: PrefixGroups
) -> list[Segment]:
    head = [] if group is None else split_tokens((NS_GROUP, seed, group), groups.prefix_tokens)
    return head + split_tokens((NS_UNIQUE, seed, index), body_tokens)
