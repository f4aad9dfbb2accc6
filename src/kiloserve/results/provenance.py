"""What a report records so a run can be reproduced (S5.5): config, versions, hashes."""

from __future__ import annotations

import hashlib
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

import orjson

from kiloserve.results.records import BenchResult

__all__ = ["config_hash", "run_info", "versions"]

_PACKAGES = ("kiloserve", "aiohttp", "numpy", "orjson")


def versions() -> dict[str, str]:
    """Versions of Python, the platform and the packages that shape the numbers."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def config_hash(config: dict[str, object]) -> str:
    """Short SHA-256 of the canonical JSON of ``config`` (sorted keys)."""
    data = orjson.dumps(config, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(data).hexdigest()[:16]


def run_info(
    result: BenchResult, slo: dict[str, float] | None, command: Sequence[str] | None
) -> dict[str, object]:
    """Provenance keys of ``summary.json``."""
    hashed = {"config": result.config, "workload": result.workload, "slo": slo or {}}
    client = result.client
    return {
        "workload": result.workload,
        "seed": result.workload.get("seed"),
        "workload_digest": result.workload_digest,
        "config": result.config,
        "config_hash": config_hash(hashed),
        "command": list(command) if command is not None else None,
        "versions": versions(),
        "started_at_unix": result.started_at_unix,
        "client_lag_ms": {
            "mean": client.lag_mean_ms,
            "p99": client.lag_p99_ms,
            "max": client.lag_max_ms,
        },
        "client_cpu_util": client.cpu_util,
        "client_max_in_flight": client.max_in_flight,
        "client_warning": client.warning(),
    }
