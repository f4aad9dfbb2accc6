"""The ``tracing`` config section (gateway/tracing.py), apart so the config loads no
OpenTelemetry or HTTP package."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["TracingConfig"]


class TracingConfig(BaseModel):
    """The ``tracing`` config section (docs/observability.md, "Tracing"): OpenTelemetry
    spans per request, exported over OTLP/HTTP (protobuf). Off by default."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "kiloserve-gateway"
    # share of new traces kept; a client's sampled traceparent is always followed
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
