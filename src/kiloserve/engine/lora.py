"""LoRA adapters on the twin, served as vLLM serves them (``--enable-lora``).

The registry holds every adapter the server knows (``--lora-modules`` at start,
``POST /v1/load_lora_adapter`` at run time when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
is set): a request whose ``model`` names one is served by the base model.

Swap cost (the step-time model's share): vLLM keeps ``max_loras`` adapters in GPU
slots and ``max_cpu_loras`` in a CPU cache, both least recently used. A request whose
adapter is not in a GPU slot makes the next engine step longer by
``LORA_GPU_SWAP_S`` (copy the weights from host memory into the slot), plus
``LORA_DISK_LOAD_S`` when the adapter is not in the CPU cache either (read it from
disk). These are the twin's constants for a rank-16 adapter of an 8B model (a few
tens of MB of weights: ~10 ms over PCIe, ~50 ms from local NVMe), not measurements.

``vllm:lora_requests_info`` is vLLM's gauge: its labels name the adapters of running
and waiting requests (comma-joined) and ``max_lora``; its value is the time of the
last update (seconds since the epoch), as vLLM's ``set_to_current_time``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiloserve.errors import ConfigError, NotFoundError, RequestError

if TYPE_CHECKING:
    from kiloserve.engine.twin import RequestStream

__all__ = [
    "LORA_DISK_LOAD_S",
    "LORA_GPU_SWAP_S",
    "LoraModule",
    "LoraRegistry",
    "parse_lora_module",
]

LORA_GPU_SWAP_S = 0.010  # host -> GPU slot, per adapter brought into the batch
LORA_DISK_LOAD_S = 0.050  # disk -> CPU cache, when the adapter is not cached


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter: its served name, its path (any string for the twin), its base."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``name=path`` or vLLM's JSON form ``{"name", "path", "base_model_name"?}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules: invalid JSON: {exc}") from exc
        if not isinstance(raw, dict) or not raw.get("name") or not raw.get("path"):
            raise ConfigError("--lora-modules: JSON needs 'name' and 'path'")
        base = raw.get("base_model_name")
        return LoraModule(str(raw["name"]), str(raw["path"]), str(base) if base else None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules: expected name=path or JSON, got {text!r}")
    return LoraModule(name, path)


def _lru_touch(cache: OrderedDict[str, None], name: str, capacity: int) -> bool:
    """Mark ``name`` used; return whether it was already cached (evicts the LRU)."""
    was_cached = name in cache
    cache[name] = None
    cache.move_to_end(name)
    while len(cache) > capacity:
        cache.popitem(last=False)
    return was_cached


@dataclass(slots=True)
class LoraRegistry:
    """The adapters a twin serves, its GPU slots and CPU cache, and the in-flight counts."""

    base_model_name: str
    max_loras: int = 1
    max_cpu_loras: int = 1
    adapters: dict[str, LoraModule] = field(default_factory=dict)
    _gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _cpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _inflight: dict[str, tuple[str, RequestStream]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:  # vLLM's rule
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    def load(self, name: object, path: object) -> str:
        """Register an adapter (vLLM's checks and messages); return the success text."""
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters:
            raise RequestError(
                f"The lora adapter '{name}' has already been loaded. If you want to load"
                " the adapter in place, set 'load_inplace' to True."
            )
        self.adapters[name] = LoraModule(name, path, self.base_model_name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: object) -> str:
        if not name or not isinstance(name, str):
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self.adapters:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        self._gpu.pop(name, None)
        self._cpu.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def swap_cost_s(self, name: str) -> float:
        """Mark ``name`` in use by a new request; the step time its loading adds."""
        if _lru_touch(self._gpu, name, self.max_loras):
            _lru_touch(self._cpu, name, self.max_cpu_loras)
            return 0.0
        in_cpu = _lru_touch(self._cpu, name, self.max_cpu_loras)
        return LORA_GPU_SWAP_S + (0.0 if in_cpu else LORA_DISK_LOAD_S)

    def track(self, name: str, stream: RequestStream) -> None:
        """Count ``stream`` (a request for adapter ``name``) until ``untrack``."""
        self._inflight[stream.seq_id] = (name, stream)

    def untrack(self, stream: RequestStream) -> None:
        self._inflight.pop(stream.seq_id, None)

    def model_cards(self, created_s: int) -> list[dict[str, object]]:
        """``/v1/models`` entries, as vLLM: ``root`` the path, ``parent`` the base."""
        return [
            {
                "id": lora.name,
                "object": "model",
                "created": created_s,
                "owned_by": "vllm",
                "root": lora.path,
                "parent": lora.base_model_name or self.base_model_name,
                "max_model_len": None,
            }
            for lora in self.adapters.values()
        ]

    def render_metric(self, now_s: float | None = None) -> str:
        """The ``vllm:lora_requests_info`` gauge in Prometheus text format."""
        now_s = time.time() if now_s is None else now_s
        running = {n for n, s in self._inflight.values() if s.is_running}
        waiting = {n for n, s in self._inflight.values() if not s.is_running}
        labels = (
            f'max_lora="{self.max_loras}",running_lora_adapters="{",".join(sorted(running))}",'
            f'waiting_lora_adapters="{",".join(sorted(waiting))}"'
        )
        return (
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f"vllm:lora_requests_info{{{labels}}} {now_s}\n"
        )
