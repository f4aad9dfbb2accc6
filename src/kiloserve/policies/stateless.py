"""Shared no-op hooks for policies that keep no state between requests."""

from __future__ import annotations

from kiloserve.policies.base import Outcome, RequestInfo

__all__ = ["StatelessHooks"]


class StatelessHooks:
    """Mixin: ``on_dispatch`` and ``on_complete`` do nothing."""

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        return None

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None
