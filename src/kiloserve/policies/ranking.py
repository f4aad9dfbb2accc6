"""Turning per-backend sort keys into a ranked tuple of backend ids (best first).

Keys are floats (sorting floats is several times faster than sorting tuples); a
secondary key is applied by a first stable sort. Sorting is stable, so equal keys keep
snapshot order: every deterministic policy breaks ties by snapshot order.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiloserve.policies.base import BackendState
from kiloserve.policies.signals import load_ranks

__all__ = ["ids", "least_load_order", "order_by", "rank_by_keys"]


def order_by(primary: Sequence[float], secondary: Sequence[float] | None = None) -> list[int]:
    """Indices sorted by ascending ``primary``, then ``secondary``, then index."""
    order = list(range(len(primary)))
    if secondary is not None:
        order.sort(key=secondary.__getitem__)
    order.sort(key=primary.__getitem__)
    return order


def ids(pool: Sequence[BackendState], order: Sequence[int]) -> tuple[str, ...]:
    """Backend ids of ``pool`` in ``order``."""
    return tuple([pool[i].backend_id for i in order])


def rank_by_keys(
    pool: Sequence[BackendState],
    primary: Sequence[float],
    secondary: Sequence[float] | None = None,
) -> tuple[str, ...]:
    """Backend ids of ``pool`` by ascending keys (ties: pool order)."""
    return ids(pool, order_by(primary, secondary))


def least_load_order(pool: Sequence[BackendState]) -> tuple[str, ...]:
    """Ids by ``signals.load_rank``: known load first, lowest load first."""
    return rank_by_keys(pool, load_ranks(pool))
