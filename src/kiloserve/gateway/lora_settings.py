"""The ``lora`` config section (gateway/lora.py), apart so the config loads no HTTP client."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoraAdapterConfig", "LoraConfig"]


class LoraAdapterConfig(BaseModel):
    """One adapter the gateway may load: its path on the engines and its base model."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    base_model: str = Field(min_length=1)


class LoraConfig(BaseModel):
    """The ``lora`` config section (docs/gateway.md, "LoRA adapters")."""

    model_config = ConfigDict(extra="forbid")

    # adapters one backend may hold; past it the least recently requested is unloaded
    max_adapters_per_backend: int = Field(default=4, ge=1)
    load_timeout_s: float = Field(default=30.0, gt=0.0)  # one load / unload call
    # adapters known ahead (name -> path, base model); others are learnt from /v1/models
    adapters: dict[str, LoraAdapterConfig] = Field(default_factory=dict)
