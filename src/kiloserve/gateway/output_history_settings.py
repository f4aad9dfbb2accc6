"""The ``output_history:`` config section (gateway/output_history.py), apart so the
config loads without the metrics client."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["OutputHistoryConfig"]


class OutputHistoryConfig(BaseModel):
    """The ``output_history:`` config section."""

    model_config = ConfigDict(extra="forbid")

    shared: bool = True  # through Redis, when a Redis URL is known
    redis_url: str | None = None  # default: rate_limit.redis_url
    key_prefix: str = "kiloserve:out:"
    channel: str = "kiloserve:out"
    ttl_s: int = Field(default=7 * 86_400, ge=1)
    flush_interval_s: float = Field(default=0.05, gt=0.0)
