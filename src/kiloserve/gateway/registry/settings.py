"""``registry:`` section of the gateway config (no imports from the gateway: no cycles)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DEFAULT_PREFIX", "RegistryConfig"]

DEFAULT_PREFIX = "/kiloserve/backends/"


class RegistryConfig(BaseModel):
    """Where backends come from: the ``backends:`` list (static) or an etcd prefix."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["static", "etcd"] = "static"
    etcd: list[str] = Field(default_factory=list)  # HOST:PORT endpoints, tried in order
    prefix: str = DEFAULT_PREFIX
    timeout_s: float = Field(default=2.0, gt=0.0)
    retry_interval_s: float = Field(default=1.0, gt=0.0)
