"""Cluster YAML for ``kiloserve up`` / ``kiloserve compare`` (pydantic, extra="forbid").

Example (see ``examples/cluster.yaml``)::

    gateway:
      port: 8000
      policy: default
    backends:
      - name: h100-llama
        gpu: H100
        model: llama-3.1-8b
        count: 2
        group: rack-a
      - name: l40s-qwen
        gpu: L40S
        model: qwen2-7b
        faults: {slowdown: 4.0}
      - name: real                      # a real engine (see docs/real-engines.md)
        engine: vllm                    # twin (default) | vllm | sglang | llama.cpp
        gpu: H100                       # informational for real engines
        model: meta-llama/Llama-3.1-8B-Instruct
        model_path: /models/llama-3.1-8b   # optional local weights (GGUF for llama.cpp)
        python: /opt/vllm/bin/python    # interpreter with the engine installed
        env: {CUDA_VISIBLE_DEVICES: "0"}
        extra_args: [--gpu-memory-utilization, "0.9"]
        kv_events_endpoint: auto        # KV-cache events (twin and vllm; below)
      - name: qwen-prefill              # disaggregated prefill/decode (P/D): a model
        gpu: H100                       # with a prefill line needs a decode line too
        model: qwen3-14b
        role: prefill                   # prefill | decode | both (default)
        kv_cpu_gib: 64                  # CPU KV tier per engine (twins), GiB
        kv_remote_gib: 0                # remote KV tier per engine (twins), GiB
      - name: qwen-decode
        gpu: H100
        model: qwen3-14b
        role: decode
        kv_link: network                # the link it pulls KV over: nvlink | network | pcie

``kv_events_endpoint`` / ``kv_events_replay_endpoint``: the backend publishes vLLM's
KV-cache events and the gateway subscribes. ``auto`` picks the addresses per replica
(twins: a free ``tcp://HOST:PORT`` each; vLLM: ``ipc://`` sockets in the replica's
scratch folder, since vLLM binds only wildcard and ipc endpoints); an explicit
``tcp://host:port`` or ``ipc://path`` is for a line with ``count: 1`` (vLLM: ipc only).

``role`` / ``kv_cpu_gib`` / ``kv_remote_gib`` / ``kv_link``: disaggregated prefill/decode
and KV tiers (docs/disaggregation.md). ``role`` is for twins and vLLM; a served model with
a ``prefill`` or ``decode`` line needs both (a ``both`` line may serve it too: short
prompts run there). The tier sizes and the link are the twin's model (``kiloserve engine
--kv-cpu-gib/--kv-remote-gib/--kv-link``); a real engine configures its own connector
through ``extra_args``.
"""

from __future__ import annotations

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

from kiloserve.errors import ConfigError
from kiloserve.validation import is_tcp_endpoint, model_at, unknown_keys_message

__all__ = [
    "AUTO",
    "KV_EVENTS_KEYS",
    "BackendSpec",
    "ClusterConfig",
    "EngineName",
    "ExpandedBackend",
    "FaultSpec",
    "GatewaySpec",
    "KvLinkName",
    "Role",
    "load_cluster_config",
    "parse_cluster_config",
]


EngineName = Literal["twin", "vllm", "sglang", "llama.cpp"]
Role = Literal["prefill", "decode", "both"]
KvLinkName = Literal["nvlink", "network", "pcie"]
AUTO = "auto"  # kv_events_endpoint: the launcher picks an address per replica
KV_EVENTS_KEYS = ("kv_events_endpoint", "kv_events_replay_endpoint")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FaultSpec(_Strict):
    """Faults a twin starts with (the same knobs as ``POST /admin/faults``)."""

    slowdown: float | None = Field(default=None, gt=0)
    error_rate: float | None = Field(default=None, ge=0, le=1)
    status: int | None = Field(default=None, ge=400, le=599)
    hang: bool = False
    stall_after_tokens: int | None = Field(default=None, ge=0)
    # thermal throttling: the ``thermal`` object of POST /admin/faults ({} = defaults),
    # checked by the twin at start-up (docs/engine-twin.md, "Thermal throttling")
    thermal: dict[str, float | None] | None = None
    # the node page's faults (docs/engine-twin.md, "Node page")
    pcie_saturation: float | None = Field(default=None, ge=0, le=1)
    nvlink_degrade_at_c: float | None = None
    xid: int | None = Field(default=None, ge=0)
    ecc_dbe_errors: int | None = Field(default=None, ge=0)


class BackendSpec(_Strict):
    """One line of the cluster: ``count`` identical backends."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    gpu: str = ""
    model: str
    tp: int = Field(default=1, ge=1, le=64)
    quant: str = "bf16"
    count: int = Field(default=1, ge=1, le=256)
    engine: EngineName = "twin"
    model_path: str | None = None
    python: str | None = None
    command: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    served_model_name: str | None = None
    group: str = ""
    version: str = ""
    cost_per_hour: float | None = Field(default=None, ge=0)
    weight: float = Field(default=1.0, ge=0)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=16)
    faults: FaultSpec | None = None
    extra_args: list[str] = Field(default_factory=list)
    kv_events_endpoint: str | None = None  # "auto", tcp://host:port or ipc://path
    kv_events_replay_endpoint: str | None = None
    role: Role = "both"  # disaggregated prefill/decode (twins and vLLM)
    kv_cpu_gib: float = Field(default=0.0, ge=0)  # CPU KV tier per engine (twins)
    kv_remote_gib: float = Field(default=0.0, ge=0)  # remote KV tier per engine (twins)
    kv_link: KvLinkName = "network"  # the link a decode engine pulls KV over (twins)

    @model_validator(mode="after")
    def _engine_keys(self) -> BackendSpec:
        if self.engine == "twin":
            if not self.gpu:
                raise ValueError("a twin needs 'gpu' (a catalog GPU name)")
            used = [k for k in ("model_path", "python", "command") if getattr(self, k)]
            if used:
                raise ValueError(f"{', '.join(used)}: only for real engines (engine: vllm, ...)")
            return self
        if self.faults is not None:
            raise ValueError("faults are injected into twins only (engine: twin)")
        if self.engine == "llama.cpp" and not self.model_path:
            raise ValueError("engine llama.cpp needs model_path (a GGUF file)")
        return self

    @model_validator(mode="after")
    def _kv_events_keys(self) -> BackendSpec:
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        for key in KV_EVENTS_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if self.engine not in ("twin", "vllm"):
                raise ValueError(f"{key}: only twins and vLLM publish KV events")
            if value != AUTO:
                _check_explicit_endpoint(key, value, self)
        return self

    @model_validator(mode="after")
    def _disagg_keys(self) -> BackendSpec:
        if self.role != "both" and self.engine not in ("twin", "vllm"):
            raise ValueError(
                f"role: {self.role}: only twins and vLLM run prefill/decode roles "
                f"(engine: {self.engine} serves whole requests; use role: both)"
            )
        if self.engine != "twin":
            used = [k for k in ("kv_cpu_gib", "kv_remote_gib") if getattr(self, k)]
            if self.kv_link != "network":
                used.append("kv_link")
            if used:
                raise ValueError(
                    f"{', '.join(used)}: the twin's KV tier/link model (engine: twin); "
                    "configure a real engine's KV connector with extra_args"
                )
        return self


def _check_explicit_endpoint(key: str, value: str, spec: BackendSpec) -> None:
    """An explicit KV events address: one replica, an address both sides can use."""
    if spec.count != 1:
        raise ValueError(
            f"{key}: an explicit endpoint serves one replica, this line has count "
            f"{spec.count}; use '{AUTO}' (a free address per replica)"
        )
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return
    if spec.engine == "vllm":
        raise ValueError(
            f"{key}: vLLM binds only wildcard and ipc:// endpoints (it connects to "
            f"tcp://host:port ones); use '{AUTO}' or ipc://PATH, got {value!r}"
        )
    if not is_tcp_endpoint(value):
        raise ValueError(
            f"{key}: must be '{AUTO}', tcp://host:port (a port, not 0) or ipc://path, got {value!r}"
        )


class GatewaySpec(_Strict):
    """Gateway settings for the local cluster; ``options`` pass through to its config."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    policy: str = "default"
    policy_params: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)


class ClusterConfig(_Strict):
    name: str = "local"
    host: str = "127.0.0.1"
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    backends: list[BackendSpec]

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, value: list[BackendSpec]) -> list[BackendSpec]:
        if not value:
            raise ValueError("at least one backend is required")
        names = [b.name for b in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"backend names must be unique; repeated: {', '.join(dupes)}")
        _check_pd_pools(value)
        return value

    @property
    def has_pd_pools(self) -> bool:
        """Whether some backend line has a prefill or decode role."""
        return any(spec.role != "both" for spec in self.backends)

    def expanded(self) -> list[ExpandedBackend]:
        """One entry per process: ``count: 2`` of ``a`` gives ``a-0`` and ``a-1``."""
        out: list[ExpandedBackend] = []
        for spec in self.backends:
            for i in range(spec.count):
                name = spec.name if spec.count == 1 else f"{spec.name}-{i}"
                out.append(ExpandedBackend(name=name, spec=spec))
        return out


def _check_pd_pools(specs: list[BackendSpec]) -> None:
    """A served model with a prefill or decode line needs both kinds of line."""
    roles: dict[str, set[str]] = {}
    for spec in specs:
        roles.setdefault(spec.served_model_name or spec.model, set()).add(spec.role)
    for model, seen in roles.items():
        missing = [r for r in ("prefill", "decode") if r not in seen]
        if len(missing) == 1:
            have = "prefill" if missing[0] == "decode" else "decode"
            raise ValueError(
                f"model {model!r} has a role: {have} backend but no role: {missing[0]} "
                f"backend; a disaggregated (P/D) model needs both (or use role: both)"
            )


class ExpandedBackend(_Strict):
    name: str
    spec: BackendSpec


def _format_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid cluster config {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            model = model_at(ClusterConfig, tuple(err["loc"]))
            msg = unknown_keys_message([err["loc"][-1]], sorted(model.model_fields))
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_cluster_config(data: Any, source: str = "<dict>") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid cluster config {source}: top level must be a mapping")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from exc


def load_cluster_config(path: str | Path) -> ClusterConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read cluster config {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"cluster config {p} is not valid YAML: {exc}") from exc
    return parse_cluster_config(data, str(p))
