"""Parse ``--workload`` strings into a ``WorkloadSpec``.

Grammar (whitespace ignored)::

    azure-conv | azure-code | mooncake [:repeat=N|inf]     shipped traces (repeat:
                                                           replay back to back)
    synthetic:input=DIST,output=DIST[,prefix_groups=N,prefix_tokens=T]
    mix:PRESET=WEIGHT,PRESET=WEIGHT[,...]                  e.g. mix:chat=0.8,longdoc=0.2
    sessions:users=U,turns=K[,input=DIST,output=DIST]      multi-turn chats
    DIST := fixed(N) | uniform(LO,HI) | lognormal(MEAN,SIGMA) | normal(MEAN,STD) | N

Commas inside parentheses belong to the distribution. Every error is a
``ConfigError`` naming the offending part and the valid choices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiloserve.errors import ConfigError

__all__ = [
    "TRACE_NAMES",
    "Dist",
    "WorkloadSpec",
    "check_keys",
    "int_option",
    "parse_dist",
    "parse_workload_spec",
]

TRACE_NAMES = ("azure-conv", "azure-code", "mooncake")
KINDS = ("synthetic", "mix", "sessions")
DIST_ARITY = {"fixed": 1, "uniform": 2, "lognormal": 2, "normal": 2}
_DIST = re.compile(r"^([a-z]+)\((.*)\)$")


@dataclass(frozen=True, slots=True)
class Dist:
    """A token-length distribution: ``kind`` in DIST_ARITY with its parameters."""

    kind: str
    params: tuple[float, ...]

    def __str__(self) -> str:
        return f"{self.kind}({','.join(f'{p:g}' for p in self.params)})"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A parsed workload string: ``kind`` is a trace name or one of KINDS."""

    kind: str
    text: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def is_trace(self) -> bool:
        return self.kind in TRACE_NAMES


def parse_workload_spec(text: str) -> WorkloadSpec:
    """Parse a ``--workload`` string (see module docstring)."""
    clean = "".join(text.split())
    if clean in TRACE_NAMES:
        return WorkloadSpec(kind=clean, text=clean)
    kind, sep, rest = clean.partition(":")
    if kind in TRACE_NAMES:
        if not rest:
            raise ConfigError(f"workload {kind!r} takes options after ':', e.g. {kind}:repeat=inf")
        return WorkloadSpec(kind=kind, text=clean, options=_parse_options(rest, text))
    if kind not in KINDS:
        valid = ", ".join((*TRACE_NAMES, *(f"{k}:..." for k in KINDS)))
        raise ConfigError(f"unknown workload {text!r}; valid: {valid}")
    if not sep or not rest:
        raise ConfigError(f"workload {kind!r} needs options after ':', e.g. {_example(kind)}")
    return WorkloadSpec(kind=kind, text=clean, options=_parse_options(rest, text))


def parse_dist(text: str) -> Dist:
    """Parse ``fixed(N)``, ``uniform(LO,HI)``, ``lognormal(MEAN,SIGMA)``, ``normal(M,S)``
    or a bare number (fixed)."""
    if _is_number(text):
        return Dist("fixed", (float(text),))
    m = _DIST.match(text)
    if m is None or m.group(1) not in DIST_ARITY:
        valid = ", ".join(f"{k}(...)" for k in DIST_ARITY)
        raise ConfigError(f"bad distribution {text!r}; valid: {valid} or a number")
    kind, args = m.group(1), [a for a in m.group(2).split(",") if a]
    if len(args) != DIST_ARITY[kind] or not all(_is_number(a) for a in args):
        raise ConfigError(f"{kind}() takes {DIST_ARITY[kind]} numbers, got {text!r}")
    params = tuple(float(a) for a in args)
    _check_dist(kind, params, text)
    return Dist(kind, params)


def _check_dist(kind: str, params: tuple[float, ...], text: str) -> None:
    if kind == "fixed" and params[0] < 1:
        raise ConfigError(f"{text!r}: a fixed length must be >= 1")
    if kind == "uniform" and not 1 <= params[0] <= params[1]:
        raise ConfigError(f"{text!r}: uniform(LO,HI) needs 1 <= LO <= HI")
    if kind in ("lognormal", "normal") and (params[0] <= 0 or params[1] < 0):
        raise ConfigError(f"{text!r}: {kind}(MEAN,SPREAD) needs MEAN > 0 and SPREAD >= 0")


def _parse_options(rest: str, original: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for part in _split_top_level(rest, original):
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"workload {original!r}: expected KEY=VALUE, got {part!r}")
        if key in options:
            raise ConfigError(f"workload {original!r}: option {key!r} given twice")
        options[key] = value
    return options


def _split_top_level(text: str, original: str) -> list[str]:
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"workload {original!r}: unbalanced ')'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"workload {original!r}: unbalanced '('")
    parts.append(text[start:])
    return parts


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _example(kind: str) -> str:
    return {
        "synthetic": "synthetic:input=lognormal(1000,0.8),output=lognormal(200,0.8)",
        "mix": "mix:chat=0.8,longdoc=0.2",
        "sessions": "sessions:users=20,turns=4",
    }[kind]


def int_option(options: Mapping[str, str], key: str, default: int) -> int:
    """A non-negative integer option, or ``default`` when absent."""
    if key not in options:
        return default
    try:
        value = int(options[key])
    except ValueError:
        raise ConfigError(f"option {key!r} must be an integer, got {options[key]!r}") from None
    if value < 0:
        raise ConfigError(f"option {key!r} must be >= 0, got {value}")
    return value


def check_keys(kind: str, options: Mapping[str, str], valid: tuple[str, ...]) -> None:
    """Reject option keys not in ``valid`` (the message lists the valid ones)."""
    for key in options:
        if key not in valid:
            raise ConfigError(f"unknown option {key!r} for {kind}; valid: {', '.join(valid)}")
