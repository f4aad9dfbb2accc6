"""LoRA adapters in a simulation: the gateway's placement rule and the twin's swap cost.

``SimLora`` decides which requests ask for an adapter (a seeded draw: ``share`` of a
base model's requests, adapters uniform), places each adapter with the live gateway's
own rule (``gateway/lora_placement.py``: route to routable holders; else load on the
policy's best backend of the base model's pool, unloading the least recently requested
adapter past ``max_adapters_per_backend``), and charges each engine step the twin's
swap cost (``engine/lora.py``: an adapter not in one of the ``max_loras`` GPU slots
adds ``LORA_GPU_SWAP_S``, plus ``LORA_DISK_LOAD_S`` when not in the
``max_cpu_loras`` CPU cache). The gateway's load call itself is taken as instant: its
time is the engine's disk load, charged to the first step that uses the adapter.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kiloserve.engine.lora import LoraModule, LoraRegistry
from kiloserve.errors import ConfigError
from kiloserve.gateway.lora_placement import Adapter, LoraPlacement
from kiloserve.sim.backend import SimBackend
from kiloserve.sim.gateway import SimGateway

__all__ = ["SimLora", "SimLoraSpec"]


@dataclass(frozen=True, slots=True)
class SimLoraSpec:
    """Adapters by name -> base model, and the share of requests that use one."""

    adapters: Mapping[str, str]
    share: float = 1.0
    max_adapters_per_backend: int = 4
    max_loras: int = 1
    max_cpu_loras: int = 4

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ConfigError(f"lora share must be in [0, 1], got {self.share}")


class SimLora:
    """Which requests use adapters, where adapters live, and what swapping costs."""

    def __init__(
        self, spec: SimLoraSpec, gateway: SimGateway, backends: Sequence[SimBackend], seed: int
    ) -> None:
        self.spec = spec
        self.gateway = gateway
        self.placement = LoraPlacement(gateway.table, gateway.router, spec.max_adapters_per_backend)
        by_base: dict[str, list[str]] = {}
        for name, base in spec.adapters.items():
            self.placement.catalog[name] = Adapter(name, name, base)
            by_base.setdefault(base, []).append(name)
        self._by_base = {base: sorted(names) for base, names in by_base.items()}
        self._index_of = {b.backend_id: b.index for b in backends}
        self._engines = [
            LoraRegistry(b.backend_id, spec.max_loras, spec.max_cpu_loras) for b in backends
        ]
        self._rng = random.Random(seed * 104_729 + 3)
        self.num_loads = 0
        self.num_unloads = 0
        self.swap_s = 0.0  # total step time added by swaps

    def model_for(self, model: str, request_id: str, now_s: float) -> str:
        """The model a request asks for: ``model`` or one of its adapters (placed)."""
        names = self._by_base.get(model)
        if not names or self._rng.random() >= self.spec.share:
            return model
        name = names[self._rng.randrange(len(names))]
        self.place(name, request_id, now_s)
        return name

    def place(self, name: str, request_id: str, now_s: float) -> None:
        placement = self.placement
        holders = placement.holders(name)
        if holders:
            placement.touch(name, holders, now_s)
            return
        backend_id = placement.pick(placement.catalog[name], request_id, now_s)
        if backend_id is None:
            return
        engine = self._engines[self._index_of[backend_id]]
        for victim in placement.victims(backend_id):
            placement.set_held(backend_id, victim, is_held=False, now_s=now_s)
            engine.unload(victim)
            self.num_unloads += 1
        placement.set_held(backend_id, name, is_held=True, now_s=now_s)
        engine.adapters[name] = LoraModule(name, name)
        self.num_loads += 1
        self.gateway.pools_changed()

    def swap_cost_s(self, backend_index: int, model: str) -> float:
        """The step time a request for ``model`` adds on the backend (0: base model)."""
        if model not in self.placement.catalog:
            return 0.0
        cost_s = self._engines[backend_index].swap_cost_s(model)
        self.swap_s += cost_s
        return cost_s

    def describe(self) -> dict[str, float | int]:
        return {"loads": self.num_loads, "unloads": self.num_unloads, "swap_s": self.swap_s}
