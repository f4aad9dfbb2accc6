"""Where LoRA adapters live, and where the next one goes: the rule, without I/O.

Shared by the live gateway (``gateway/lora.py``, which adds the load / unload calls)
and the simulator (``sim/lora.py``), so both place adapters the same way:

* ``holders``: routable backends whose models include the adapter;
* ``pick``: the policy's best routable backend of the base model's pool (its own
  ranking for a request of the base model);
* ``victims``: what to unload first so one more fits the per-backend budget, least
  recently requested first ("requested": ``touch``, when a request for the adapter
  reached the gateway while the backend held it; loading counts as a request).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.policies.base import RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

__all__ = ["Adapter", "LoraPlacement"]


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    base_model: str


class LoraPlacement:
    """The adapter catalog, each backend's last-request times, and the placement rule."""

    def __init__(self, table: BackendTable, router: Router, max_adapters_per_backend: int) -> None:
        self.table = table
        self.router = router
        self.max_adapters_per_backend = max_adapters_per_backend
        self.catalog: dict[str, Adapter] = {}
        self._last_used: dict[tuple[str, str], float] = {}  # (backend, adapter) -> time

    def holders(self, name: str) -> list[str]:
        return sorted(b for b in self.table.pool_ids(name) if self.table.is_routable(b))

    def touch(self, name: str, holders: list[str], now_s: float) -> None:
        for backend_id in holders:
            self._last_used[(backend_id, name)] = now_s

    def note_used(self, backend_id: str, name: str, when_s: float) -> None:
        """A request for adapter ``name`` reached ``backend_id`` at ``when_s`` (through a
        sibling worker: gateway/lora_shared.py); the newer time is kept."""
        key = (backend_id, name)
        if when_s > self._last_used.get(key, -1.0):
            self._last_used[key] = when_s

    def pick(self, adapter: Adapter, request_id: str, now_s: float) -> str | None:
        info = RequestInfo(request_id, adapter.base_model, 0, 0)
        decision = self.router.policy.choose(info, self.table.snapshot(now_s), self.router.rng)
        pool = self.table.pool_ids(adapter.base_model)
        for backend_id in decision.ranked:
            if backend_id in pool and self.table.is_routable(backend_id):
                return backend_id
        return None

    def adapters_on(self, backend_id: str) -> list[str]:
        return sorted(m for m in self.table.state(backend_id).models if m in self.catalog)

    def victims(self, backend_id: str) -> list[str]:
        """Adapters to unload from ``backend_id`` so one more fits, in unload order."""
        held = self.adapters_on(backend_id)
        held.sort(key=lambda n: self._last_used.get((backend_id, n), 0.0))
        return held[: max(0, len(held) - self.max_adapters_per_backend + 1)]

    def set_held(self, backend_id: str, name: str, *, is_held: bool, now_s: float) -> None:
        """Record a load (``is_held``) or an unload in the backend's models."""
        models = set(self.table.state(backend_id).models)
        if is_held:
            models.add(name)
            self._last_used[(backend_id, name)] = now_s
        else:
            models.discard(name)
            self._last_used.pop((backend_id, name), None)
        self.table.set_models(backend_id, models)

    def sync_held(self, backend_id: str, listed: set[str], now_s: float) -> None:
        """The adapters ``backend_id`` lists now replace the known ones it held."""
        models = set(self.table.state(backend_id).models)
        held = {m for m in models if m in self.catalog}
        for name in listed - held:
            self._last_used.setdefault((backend_id, name), now_s)
        if held != listed:
            self.table.set_models(backend_id, (models - held) | listed)
