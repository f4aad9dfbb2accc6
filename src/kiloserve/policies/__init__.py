"""Routing policies: pure ``choose(request, snapshot, rng) -> Decision`` functions.

Callers (gateway, simulator) use only ``create_policy`` / ``available_policies`` and
the ``Policy`` protocol with the ``base`` data types re-exported here. See
docs/policies.md for every algorithm and threshold.
"""

from __future__ import annotations

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
