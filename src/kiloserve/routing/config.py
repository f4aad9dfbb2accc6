"""One backend's static configuration (the gateway YAML's ``backends:`` entries).

It lives in ``routing`` because the backend table is built from it, in the live
gateway and in the simulator alike; ``kiloserve.gateway.config`` re-exports it.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiloserve.validation import is_tcp_endpoint

__all__ = ["BackendConfig", "EngineKind"]

EngineKind = Literal["vllm", "sglang", "llamacpp", "tgi", "auto"]


class BackendConfig(BaseModel):
    """One engine instance. ``models`` empty means: discover from ``/v1/models``."""

    model_config = ConfigDict(extra="forbid")

    url: str
    name: str | None = None
    models: list[str] = Field(default_factory=list)
    gpu: str = ""
    tp: int = Field(default=1, ge=1, le=64)  # GPUs per replica (with ``gpu``: prefill prior)
    group: str = ""
    version: str = ""
    cost_per_hour: float = Field(default=0.0, ge=0.0)
    weight: float = Field(default=1.0, ge=0.0)
    engine: EngineKind = "auto"
    # disaggregated prefill/decode (routing/disagg.py): a ``prefill`` backend computes
    # prompts for a remote decode, a ``decode`` one continues them, ``both`` runs whole
    role: Literal["prefill", "decode", "both"] = "both"
    kv_capacity_tokens: int | None = Field(default=None, ge=1)  # admission budget (admission.md)
    # vLLM's --kv-events-config publisher (docs/kv-events.md): the gateway subscribes
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # the node's dcgm-exporter page (a twin's /node/metrics): PCIe load, Xid, ECC, heat
    node_metrics_url: str | None = None

    @field_validator("url")
    @classmethod
    def _plain_http(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"must be an http://host:port URL (https is not supported), got {url!r}"
            )
        return url

    @field_validator("node_metrics_url")
    @classmethod
    def _node_metrics_url(cls, url: str | None) -> str | None:
        return None if url is None else cls._plain_http(url)

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
            return endpoint
        if not is_tcp_endpoint(endpoint):
            raise ValueError(
                "must be a ZMQ endpoint to connect to, tcp://host:port or ipc://path, "
                f"got {endpoint!r}"
            )
        return endpoint

    @property
    def backend_id(self) -> str:
        """The configured name, else the URL (also the ``x-kiloserve-backend`` value)."""
        return self.name or self.url.rstrip("/")
