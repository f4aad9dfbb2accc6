"""Gateway configuration: pydantic models loaded once from YAML.

The schema is a contract (``kiloserve up`` writes it); every key is documented in
docs/gateway.md. A typo is a ``ConfigError`` naming the bad key and the valid ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kiloserve.cpus import usable_cpus
from kiloserve.errors import ConfigError
from kiloserve.gateway.admission.auth import AuthConfig
from kiloserve.gateway.admission.queue import AdmissionConfig
from kiloserve.gateway.admission.ratelimit import RateLimitConfig
from kiloserve.gateway.dashboard_state import DashboardConfig
from kiloserve.gateway.lora_settings import LoraConfig
from kiloserve.gateway.migrate import MigrationConfig
from kiloserve.gateway.model_select import ModelFromConfig
from kiloserve.gateway.output_history_settings import OutputHistoryConfig
from kiloserve.gateway.peer_settings import PeerConfig
from kiloserve.gateway.registry.settings import RegistryConfig
from kiloserve.gateway.resilience.demotion import DemotionConfig
from kiloserve.gateway.resilience.health import HealthConfig
from kiloserve.gateway.resilience.outlier import OutlierConfig
from kiloserve.gateway.tracing_settings import TracingConfig
from kiloserve.httpguard import split_host
from kiloserve.routing.config import BackendConfig
from kiloserve.routing.disagg import DisaggConfig
from kiloserve.validation import model_at, unknown_keys_message

__all__ = [
    "ADMIN_TOKEN_ENV",
    "BackendConfig",
    "GatewayConfig",
    "ModelConfig",
    "PolicyConfig",
    "auto_workers",
    "load_gateway_config",
    "parse_gateway_config",
    "resolve_workers",
]

ADMIN_TOKEN_ENV = "KILOSERVE_ADMIN_TOKEN"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicyConfig(_Strict):
    """Which routing policy (a registry name) and its parameters."""

    name: str = "default"
    params: dict[str, Any] = Field(default_factory=dict)


class ModelConfig(_Strict):
    """Per-model settings: an optional HuggingFace ``tokenizer.json`` path (exact token
    ids, docs/gateway.md "Tokens") and a chat template file (a jinja file, as vLLM's
    ``--chat-template``; default: ``chat_template.jinja`` or the ``chat_template`` of
    ``tokenizer_config.json`` next to the tokenizer, read with its special tokens);
    ``tokenizer_self_check_every``: one prompt in this many that went through the exact
    tokenizer's pieces is also encoded whole and compared (0: never;
    gateway/exact_tokens.py, gateway/fast_bpe.py)."""

    tokenizer: str | None = None
    chat_template: str | None = None
    tokenizer_self_check_every: int = Field(500, ge=0)

    @model_validator(mode="after")
    def _template_needs_tokenizer(self) -> ModelConfig:
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("chat_template needs tokenizer (the template's text is encoded)")
        return self


def resolve_workers(value: object) -> object:
    """``workers: auto`` -> one per usable CPU (``kiloserve.cpus.usable_cpus``, at most
    256); anything else as it is (validated as a number by the model)."""
    return auto_workers() if value == "auto" else value


def auto_workers() -> int:
    """What ``workers: auto`` gives: one per usable CPU, at most 256."""
    return min(256, usable_cpus())


class GatewayConfig(_Strict):
    """The whole gateway configuration (see docs/gateway.md for every key)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    scrape_interval_s: float = Field(default=0.2, gt=0.0)
    scrape_timeout_s: float = Field(default=0.5, gt=0.0)
    stale_after_s: float = Field(default=1.0, gt=0.0)
    max_scrape_failures: int = Field(default=3, ge=1)
    discovery_interval_s: float = Field(default=5.0, gt=0.0)
    # GET /v1/models reuses the merged cards this long (0: ask live; model_cards.py)
    model_cards_ttl_s: float = Field(default=5.0, ge=0.0)
    retries: int = Field(default=2, ge=0)
    connect_timeout_s: float = Field(default=2.0, gt=0.0)
    first_byte_timeout_s: float = Field(default=60.0, gt=0.0)
    non_stream_timeout_s: float = Field(default=300.0, gt=0.0)
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    max_idle_connections: int = Field(default=256, ge=0)
    max_in_flight: int = Field(default=10_000, ge=1)
    # slow clients and resource caps (docs/gateway.md, "Limits and timeouts")
    client_header_timeout_s: float = Field(default=10.0, gt=0.0)
    client_body_timeout_s: float = Field(default=30.0, gt=0.0)
    keepalive_timeout_s: float = Field(default=60.0, gt=0.0)
    max_connections: int | None = Field(default=None, ge=1)  # None: from RLIMIT_NOFILE
    max_buffered_body_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    profile_offload_bytes: int = Field(default=64 * 1024, ge=0)
    admin_token: str | None = None
    # names (``name`` or ``name:port``) the admin API and dashboard answer besides IP
    # addresses, localhost and ``host`` (DNS rebinding guard; docs/gateway.md)
    admin_allowed_hosts: list[str] = Field(default_factory=list)
    metrics_token: str | None = None  # when set, GET /metrics needs it as a bearer token
    block_size: int = Field(default=16, ge=1)
    max_prefix_tokens: int = Field(default=8192, ge=0)
    default_output_tokens: int = Field(default=256, ge=1)
    # the output-length history, shared through Redis (gateway/output_history.py)
    output_history: OutputHistoryConfig = Field(default_factory=OutputHistoryConfig)
    seed: int | None = None
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    # the model from a header or a verified JWT claim (docs/gateway.md, "Model selection")
    model_from: ModelFromConfig = Field(default_factory=ModelFromConfig)
    backends: list[BackendConfig] = Field(default_factory=list)
    # admission and flow control, API keys, rate limits (docs/admission.md)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    # gateways that share their in-flight view through Redis (gateway/peers.py)
    peers: PeerConfig = Field(default_factory=PeerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)  # adapters (gateway/lora.py)
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)  # docs/dashboard.md
    tracing: TracingConfig = Field(default_factory=TracingConfig)  # docs/observability.md
    # fault tolerance (docs/fault-tolerance.md)
    health: HealthConfig = Field(default_factory=HealthConfig)
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    demotion: DemotionConfig = Field(default_factory=DemotionConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    # mid-stream failover and stall detection (docs/gateway.md, "Mid-stream failover")
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    # disaggregated prefill/decode: split rule and prefill leg (docs/gateway.md,
    # "Disaggregated prefill/decode"; routing/disagg.py, gateway/disagg.py)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)
    shutdown_grace_s: float = Field(default=30.0, ge=0.0)
    # glibc malloc_trim(0) every this many seconds (0: never; gateway/heap.py)
    malloc_trim_interval_s: float = Field(default=60.0, ge=0.0)
    # ask each engine its version and model every this many seconds (0: never; S5.5,
    # gateway/inventory.py)
    inventory_interval_s: float = Field(default=60.0, ge=0.0)
    # the event loop: uvloop when installed (auto), or the standard library's (asyncio)
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # processes serving the port (SO_REUSEPORT) with one shared in-flight view
    # (gateway/workers.py, docs/gateway.md "Workers"); "auto": one per usable CPU
    # (the cores this process may run on, capped by its container's CPU limit), the
    # default; 1: one process, no supervisor
    workers: int = Field(default_factory=auto_workers, ge=1, le=256)

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_workers(cls, value: object) -> object:
        return resolve_workers(value)

    @field_validator("admin_allowed_hosts")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        for name in names:
            split_host(name)  # ValueError: a malformed name (a URL, a path, a bad port)
        return names

    @model_validator(mode="after")
    def _unique_backend_ids(self) -> GatewayConfig:
        ids = [b.backend_id for b in self.backends]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate backend names/urls: {dupes}")
        return self

    @model_validator(mode="after")
    def _peers_need_redis(self) -> GatewayConfig:
        if self.peers.enabled and not self.peers_redis_url():
            raise ValueError("peers.enabled needs peers.redis_url (or rate_limit.redis_url)")
        return self

    def peers_redis_url(self) -> str | None:
        """Where the peer channel lives: ``peers.redis_url``, else the rate limits' Redis."""
        return self.peers.redis_url or self.rate_limit.redis_url

    def output_history_redis_url(self) -> str | None:
        """Where the output-length history is shared: ``output_history.redis_url``, else
        the rate limits' Redis; None when not shared."""
        if not self.output_history.shared:
            return None
        return self.output_history.redis_url or self.rate_limit.redis_url

    def effective_admin_token(self) -> str | None:
        """``admin_token`` from the file, else the ``KILOSERVE_ADMIN_TOKEN`` env var."""
        return self.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None

    def redacted(self) -> dict[str, Any]:
        """The effective config as a dict with secrets replaced by ``"***"``."""
        data = self.model_dump(mode="json")
        data["admin_token"] = "***" if self.effective_admin_token() else None
        data["metrics_token"] = "***" if self.metrics_token else None
        return data


def _valid_keys(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The pydantic model that owns the key at ``loc`` (for 'valid keys' hints)."""
    return model_at(GatewayConfig, loc)


def _explain(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(unknown_keys_message([where], _valid_keys(_model_at(loc))))
        else:
            lines.append(f"'{where}': {err['msg']}")
    return ConfigError(f"{source}: " + "; ".join(lines))


def parse_gateway_config(data: Any, source: str = "gateway config") -> GatewayConfig:
    """Validate a mapping (e.g. parsed YAML) into a ``GatewayConfig``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, source) from exc


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Load and validate a gateway YAML file; errors name the bad key and valid ones."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read gateway config {p}: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from exc
    return parse_gateway_config(data, source=str(p))
