"""The ``Policy`` protocol: the routing contract every policy implements.

It lives in its own module, which the compiled build (``scripts/build_compiled.py``)
never compiles: mypyc cannot compile ``@runtime_checkable`` Protocols (mypyc issue
909). ``kiloserve.policies.base`` re-exports it, so ``from kiloserve.policies.base
import Policy`` keeps working everywhere.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kiloserve.policies.base import ClusterSnapshot, Decision, Outcome, RequestInfo

__all__ = ["Policy"]


@runtime_checkable
class Policy(Protocol):
    """Routing policy. ``choose`` is pure; hooks may update the policy's own state.

    Optional attribute ``reads_prefix_hashes`` (bool, taken as True when absent): False
    says ``choose`` and the hooks never read ``RequestInfo.prefix_hashes``, so the
    simulator leaves them empty instead of hashing every prompt (round robin and the
    least-load policies say so; ``scored`` says so when no scorer of its reads them).
    """

    name: str

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision: ...

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None: ...

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None: ...
