"""Routing policies: pure ``choose(request, snapshot, rng) -> Decision`` functions.

Callers (gateway, simulator) use only ``create_policy`` / ``available_policies`` and
the ``Policy`` protocol with the ``base`` data types re-exported here. See
docs/policies.md for every algorithm and threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiloserve.lazy import lazy_exports

if TYPE_CHECKING:
    from kiloserve.policies.base import (
        BackendState,
        ClusterSnapshot,
        Decision,
        Outcome,
        Policy,
        RequestInfo,
        eligible,
    )
    from kiloserve.policies.registry import available_policies, create_policy

__all__ = [
    "BackendState",
    "ClusterSnapshot",
    "Decision",
    "Outcome",
    "Policy",
    "RequestInfo",
    "available_policies",
    "create_policy",
    "eligible",
]

_HOMES = {
    "BackendState": "kiloserve.policies.base",
    "ClusterSnapshot": "kiloserve.policies.base",
    "Decision": "kiloserve.policies.base",
    "Outcome": "kiloserve.policies.base",
    "Policy": "kiloserve.policies.base",
    "RequestInfo": "kiloserve.policies.base",
    "available_policies": "kiloserve.policies.registry",
    "create_policy": "kiloserve.policies.registry",
    "eligible": "kiloserve.policies.base",
}
__getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)
