"""The value an agent stores under ``PREFIX + name``: a backend's description (JSON).

::

    {"name": "h100-0", "url": "http://10.0.0.5:8000", "models": ["llama-3.1-8b"],
     "gpu": "H100", "group": "", "version": "", "weight": 1.0, "engine": "auto",
     "draining": false, "health": {"score": 1.0, "nvml": null},
     "moves": ["5b0c...-uuid"]}

``draining`` is the agent's verdict from node health (S3.3): the gateway stops sending
new requests but lets in-flight ones finish. ``moves`` lists the ids of the last state
moves applied to the record (``registry/moves.py``, S3.5: a retried move is a no-op).
Unknown keys are ignored (newer agents).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from kiloserve.errors import ConfigError
from kiloserve.gateway.config import BackendConfig

__all__ = ["RegistryRecord", "decode_record", "encode_record"]

_BACKEND_KEYS = (
    "url",
    "name",
    "models",
    "gpu",
    "group",
    "version",
    "weight",
    "engine",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "node_metrics_url",
)


@dataclass(frozen=True, slots=True)
class RegistryRecord:
    backend: BackendConfig
    is_draining: bool = False
    health: dict[str, Any] | None = None
    move_ids: tuple[str, ...] = ()  # the last state moves applied (registry/moves.py)


def encode_record(record: RegistryRecord) -> bytes:
    data = record.backend.model_dump(mode="json", include=set(_BACKEND_KEYS))
    data["draining"] = record.is_draining
    data["health"] = record.health
    if record.move_ids:
        data["moves"] = list(record.move_ids)
    return orjson.dumps(data)


def decode_record(raw: bytes, key: str) -> RegistryRecord:
    """Parse one registry value; ``ConfigError`` names the key when it is malformed."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"registry key {key}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"registry key {key}: value must be a JSON object")
    fields = {k: data[k] for k in _BACKEND_KEYS if k in data}
    try:
        backend = BackendConfig.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(f"registry key {key}: {exc.errors()[0]['msg']}") from exc
    health = data.get("health")
    moves = data.get("moves")
    move_ids = tuple(m for m in moves if isinstance(m, str)) if isinstance(moves, list) else ()
    return RegistryRecord(
        backend,
        bool(data.get("draining")),
        health if isinstance(health, dict) else None,
        move_ids,
    )
