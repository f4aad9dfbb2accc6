"""Scheduled faults for what-if runs: a backend dies, slows down or recovers at time t.

From the CLI (``--fault`` may repeat)::

    --fault "t=30,backend=h100-0,kind=die"
    --fault "t=45,backend=h100-1,kind=slow,factor=3"
    --fault "t=90,backend=h100-0,kind=recover"

or from YAML (``--faults FILE``): a list of mappings with the same keys. ``die``
drops the backend's engine (requests that got no byte yet fail over to the next
ranked backend, as the gateway's retries do; streams already started are cut);
``slow`` multiplies its step times by ``factor`` (as the twin's ``slowdown``);
``recover`` brings a dead backend back with an empty cache and resets the slowdown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kiloserve.errors import ConfigError
from kiloserve.validation import unknown_keys_message

__all__ = ["FAULT_KINDS", "FaultEvent", "load_faults", "parse_fault", "parse_faults"]

FAULT_KINDS = ("die", "slow", "recover")
_KEYS = ("t", "backend", "kind", "factor")


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One scheduled fault: ``kind`` happens to ``backend`` at simulated time ``time_s``."""

    time_s: float
    backend: str
    kind: str
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.time_s) or self.time_s < 0:
            raise ConfigError(f"fault time must be >= 0 s, got {self.time_s}")
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}; valid: {', '.join(FAULT_KINDS)}")
        if not self.factor > 0 or not math.isfinite(self.factor):
            raise ConfigError(f"fault factor must be > 0, got {self.factor}")
        if not self.backend:
            raise ConfigError("a fault needs backend=NAME")


def parse_fault(text: str) -> FaultEvent:
    """Parse ``t=30,backend=h100-0,kind=die[,factor=3]``."""
    values: dict[str, str] = {}
    for part in "".join(text.split()).split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in _KEYS:
            raise ConfigError(f"bad fault part {part!r} in {text!r}; keys: {', '.join(_KEYS)}")
        values[key] = value
    return _from_mapping(values, text)


def _from_mapping(values: Mapping[str, Any], source: str) -> FaultEvent:
    unknown = sorted(str(k) for k in values if k not in _KEYS)
    if unknown:
        raise ConfigError(f"fault {source}: {unknown_keys_message(unknown, _KEYS)}")
    if "t" not in values or "backend" not in values or "kind" not in values:
        raise ConfigError(f"fault {source}: needs t=, backend= and kind=")
    try:
        time_s = float(values["t"])
        factor = float(values.get("factor", 1.0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"fault {source}: t and factor must be numbers") from exc
    return FaultEvent(time_s, str(values["backend"]), str(values["kind"]), factor)


def parse_faults(items: Sequence[Any], source: str = "faults") -> list[FaultEvent]:
    """Faults from a parsed YAML list (each item a mapping or a ``--fault`` string)."""
    out: list[FaultEvent] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(parse_fault(item))
        elif isinstance(item, Mapping):
            out.append(_from_mapping(item, f"{source}[{i}]"))
        else:
            raise ConfigError(f"{source}[{i}]: expected a mapping, got {item!r}")
    return sorted(out, key=lambda f: f.time_s)


def load_faults(path: str | Path) -> list[FaultEvent]:
    """Read a YAML list of faults (or a mapping with a ``faults:`` list)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read faults file {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"faults file {p} is not valid YAML: {exc}") from exc
    if isinstance(data, Mapping):
        data = data.get("faults")
    if not isinstance(data, list):
        raise ConfigError(f"faults file {p}: expected a list of faults")
    return parse_faults(data, str(p))
