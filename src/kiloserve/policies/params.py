"""Base of every policy's parameter model: unknown keys are errors, values frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["PolicyParams"]


class PolicyParams(BaseModel):
    """Policy parameters as read from YAML; ``extra="forbid"`` names a typo'd key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
