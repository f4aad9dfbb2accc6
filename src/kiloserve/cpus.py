"""How many CPUs this process may use: the cores it may run on, capped by its
container's CPU limit.

``usable_cpus()`` is the smaller of the scheduler affinity (``taskset``, a cpuset) and
the CPU quota of the cgroup (a container's ``--cpus`` / a Kubernetes CPU limit): cgroup
v2's ``cpu.max`` (``"200000 100000"`` = 2 CPUs, ``"max ..."`` = no limit) or cgroup v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 = no limit), read where the cgroup
file system is mounted (``/sys/fs/cgroup``: in a container, its own group). A
fractional quota rounds up (1.5 CPUs -> 2), never below 1. ``kiloserve gateway
--workers auto`` starts this many workers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["CGROUP_ROOT", "cgroup_cpu_limit", "usable_cpus"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path | None = None) -> float | None:
    """The cgroup's CPU quota in CPUs (``1.5``), or None when it sets none (``root``:
    the cgroup mount, default ``CGROUP_ROOT``)."""
    root = CGROUP_ROOT if root is None else root
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max":
            return None
        try:
            return int(quota) / int(period or "100000")
        except (ValueError, ZeroDivisionError):
            return None
    quota_text = _read(root / "cpu" / "cpu.cfs_quota_us")
    period_text = _read(root / "cpu" / "cpu.cfs_period_us")
    try:
        quota_us, period_us = int(quota_text or "-1"), int(period_text or "100000")
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us


def _affinity() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def usable_cpus(root: Path | None = None) -> int:
    """The cores this process may run on, capped by the cgroup's CPU quota (>= 1)."""
    cores = _affinity()
    limit = cgroup_cpu_limit(root)
    if limit is None:
        return cores
    return max(1, min(cores, math.ceil(limit)))
