"""The ``peers`` config section (gateway/peers.py), apart so the config loads no Redis,
HTTP or metrics client."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PeerConfig"]


class PeerConfig(BaseModel):
    """The ``peers`` config section (docs/gateway.md, "Gateways that act as one")."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    redis_url: str | None = None  # None: rate_limit.redis_url
    channel: str = "kiloserve:load"
    flush_interval_s: float = Field(default=0.01, gt=0.0)
    snapshot_interval_s: float = Field(default=1.0, gt=0.0)
    peer_timeout_s: float = Field(default=3.0, gt=0.0)
