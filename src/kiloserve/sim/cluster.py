"""The simulated cluster: backends built like ``kiloserve up`` builds twins, and the
simulated gateway's view of them (the gateway's own ``BackendTable``).

Each backend gets the engine config the twin builds (``engine.twin.build_twin``: the
memory ledger at ``gpu_memory_utilization`` 0.92, vLLM's ``max_num_seqs`` /
``max_num_batched_tokens`` for the GPU unless the YAML sets them, the model's
``max_model_len``, the line's ``role`` and KV tiers), the roofline ``StepTimeModel``,
its per-request API overhead and the KV link a decode engine pulls over (``kv_link``).
The gateway table is ``kiloserve.routing.table.BackendTable`` fed with the same
gateway YAML ``kiloserve up`` writes, so the live counters, EWMAs, staleness and health
rules are the gateway's own code.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from kiloserve.catalog import get_gpu, get_model
from kiloserve.engine.setup import engine_config_for
from kiloserve.engine.timing import StepTimeModel
from kiloserve.engine.transfer import link_for
from kiloserve.errors import ConfigError
from kiloserve.gateway.config import GatewayConfig, parse_gateway_config
from kiloserve.launch.cluster import BackendInfo, describe_backend, gateway_config
from kiloserve.launch.config import BackendSpec, ClusterConfig
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.table import BackendRecord, BackendTable
from kiloserve.sim.backend import BackendModel, SimBackend
from kiloserve.sim.kvevents import SimKvEvents

__all__ = [
    "GPU_MEMORY_UTILIZATION",
    "backend_model",
    "build_backends",
    "build_gateway_config",
    "describe_backends",
    "scrape_into",
]

logger = logging.getLogger(__name__)

GPU_MEMORY_UTILIZATION = 0.92  # the twin's default (TwinConfig / kiloserve engine)


def backend_model(spec: BackendSpec) -> BackendModel:
    """Engine config, timer and API overhead of one cluster line (as ``build_twin``)."""
    if spec.engine != "twin":
        raise ConfigError(
            f"backend {spec.name}: the simulator models engine twins only, not "
            f"engine: {spec.engine} (simulate a twin with the same gpu and model instead)"
        )
    gpu, model = get_gpu(spec.gpu), get_model(spec.model)
    engine_config, ledger = engine_config_for(
        gpu,
        model,
        spec.tp,
        spec.quant,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        kv_cpu_gib=spec.kv_cpu_gib,
        kv_remote_gib=spec.kv_remote_gib,
        role=spec.role,
    )
    timer = StepTimeModel(gpu, model, spec.tp, spec.quant)
    slowdown = 1.0
    if spec.faults is not None:
        slowdown = spec.faults.slowdown or 1.0
        _warn_unmodelled(spec)
    return BackendModel(
        engine_config,
        timer,
        timer.per_request_api_overhead_s,
        ledger.kv_capacity_tokens,
        slowdown,
        link_for(gpu, spec.kv_link),
    )


def _warn_unmodelled(spec: BackendSpec) -> None:
    f = spec.faults
    if f is not None and (f.error_rate or f.hang or f.stall_after_tokens is not None):
        logger.warning(
            "backend %s: only the slowdown fault is simulated (error_rate, hang and "
            "stall_after_tokens are not); use scheduled faults instead",
            spec.name,
        )


def describe_backends(cfg: ClusterConfig) -> list[BackendInfo]:
    """What ``kiloserve up`` would print per backend (URL ``http://NAME.sim``: never opened)."""
    return [describe_backend(item, f"http://{item.name}.sim") for item in cfg.expanded()]


def build_backends(
    cfg: ClusterConfig,
    *,
    fast_forward: bool = True,
    kv_events: SimKvEvents | None = None,
    publishers: Collection[str] = (),
) -> list[SimBackend]:
    """One ``SimBackend`` per expanded backend, in YAML order; those named in
    ``publishers`` publish KV events into ``kv_events``."""
    models: dict[str, BackendModel] = {}
    out: list[SimBackend] = []
    changed: set[int] = set()  # one set for the cluster: the scrape round's work list
    for index, item in enumerate(cfg.expanded()):
        shared = models.get(item.spec.name)
        if shared is None:
            shared = models[item.spec.name] = backend_model(item.spec)
        events = kv_events if item.name in publishers else None
        backend = SimBackend(
            index, item.name, shared, fast_forward=fast_forward, changed=changed, kv_events=events
        )
        out.append(backend)
    return out


def build_gateway_config(
    cfg: ClusterConfig, infos: list[BackendInfo], scrape_interval_s: float
) -> GatewayConfig:
    """The gateway config ``kiloserve up`` would write, with the simulated scrape interval."""
    data: dict[str, Any] = gateway_config(cfg, infos, port=0)
    data["scrape_interval_s"] = scrape_interval_s
    return parse_gateway_config(data, "simulated gateway")


def scrape_into(
    table: BackendTable, record: BackendRecord, backend: SimBackend, now_s: float
) -> None:
    """One scrape of ``backend``: its engine's stats, or a failed scrape if it is dead.

    If the engine has not changed since the last successful scrape, ``record_scrape``
    would only move the scrape time, so only that is done (the hot path of a large
    cluster whose backends sit in long fused decode runs).
    """
    core = backend.core
    if core is None:
        table.record_scrape_failure(backend.backend_id, now_s, "ClientConnectorError")
        return
    is_same = backend.scraped_version == backend.state_version
    if is_same and record.last_scrape_ok_s is not None and not record.state.scrape_stale:
        record.last_scrape_ok_s = now_s
        return
    backend.scraped_version = backend.state_version
    queries = core.prefix_cache_queries_tokens
    metrics = EngineMetrics(
        engine="vllm",
        num_running=core.num_running,
        num_waiting=core.num_waiting,
        kv_usage=min(1.0, max(0.0, core.kv_usage)),
        prefix_hit_rate=core.prefix_cache_hits_tokens / queries if queries else None,
        num_preemptions=core.num_preemptions_total,
    )
    table.record_scrape(backend.backend_id, metrics, now_s)


def pool_gpu_shares(infos: list[BackendInfo]) -> Mapping[str, float]:
    """Served model -> number of GPUs serving it (YAML order of first appearance)."""
    shares: dict[str, float] = {}
    for info in infos:
        shares[info.model] = shares.get(info.model, 0.0) + info.tp
    return shares
