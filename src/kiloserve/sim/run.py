"""``simulate()``: the public entry point (used by ``kiloserve sim`` and the planner)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiloserve.errors import ConfigError
from kiloserve.launch.cluster import BackendInfo
from kiloserve.launch.config import ClusterConfig
from kiloserve.policies.base import Policy
from kiloserve.policies.registry import create_policy
from kiloserve.results.metrics import Slo
from kiloserve.results.provenance import config_hash, versions
from kiloserve.results.records import RequestRecord
from kiloserve.sim.cluster import (
    build_backends,
    build_gateway_config,
    describe_backends,
    pool_gpu_shares,
)
from kiloserve.sim.disagg import SimDisagg, kv_tier_summary
from kiloserve.sim.faults import FaultEvent
from kiloserve.sim.gateway import ModelPicker, SimGateway
from kiloserve.sim.kvevents import SimKvEvents
from kiloserve.sim.lora import SimLora, SimLoraSpec
from kiloserve.sim.prompts import PromptIds
from kiloserve.sim.results import MetricsCollector, TimeSeries
from kiloserve.sim.sequence import BLOCK_SIZE
from kiloserve.sim.simulator import Simulator
from kiloserve.workload import RequestSpec, Workload
from kiloserve.workload.digest import WorkloadDigest

__all__ = ["SimResult", "simulate"]

SAMPLE_INTERVAL_S = 1.0  # first time-series interval; doubles as the run grows


@dataclass(slots=True)
class SimResult:
    """A simulation's outcome.

    ``summary`` is a bench ``summary.json`` dict plus ``sim_wall_s``, ``sim_cpu_s``,
    ``simulated_requests``, ``simulated_duration_s``, ``arrival_span_s`` (the last
    arrival), ``real_time_factor``, ``requests_per_wall_s``, ``sim_stats`` and
    ``backend_timeseries`` (downsampled utilisation and KV usage per backend); with
    prefill/decode-role backends also ``kv_transfer_ms`` (the shape of ``ttft_ms``)
    and ``disagg`` (split / colocated / fallback counts), with KV tiers ``kv_tiers``.
    ``routing`` and ``records`` are filled only with ``keep_records``.
    """

    summary: dict[str, Any]
    routing: list[tuple[str, str]] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    timeseries: dict[str, Any] = field(default_factory=dict)

    @property
    def sim_wall_s(self) -> float:
        return float(self.summary["sim_wall_s"])

    @property
    def simulated_requests(self) -> int:
        return int(self.summary["simulated_requests"])


def simulate(
    cluster: ClusterConfig,
    workload: Workload,
    policy: str | Policy,
    *,
    policy_params: Mapping[str, Any] | None = None,
    seed: int = 0,
    scrape_interval_s: float = 0.2,
    network_delay_s: float = 0.0005,
    faults: Sequence[FaultEvent] = (),
    keep_records: bool = False,
    progress: Callable[[int], None] | None = None,
    slo: Slo | None = None,
    model: str | None = None,
    fast_forward: bool = True,
    traces_dir: str | Path | None = None,
    command: Sequence[str] | None = None,
    lora: SimLoraSpec | None = None,
) -> SimResult:
    """Simulate ``workload`` through the gateway (``policy``) over ``cluster``.

    ``model`` sends every request to one served model (as ``kiloserve compare`` does);
    ``None`` draws each request's model weighted by the pools' GPU counts. The workload
    must be open loop (arrival times). ``fast_forward=False`` steps every decode step
    singly (same results; for tests). ``lora``: requests use LoRA adapters, placed
    and swapped as the gateway and the twin do (``sim.lora``; summary ``lora``).
    Raises ``ConfigError`` for bad inputs.
    """
    if scrape_interval_s <= 0 or network_delay_s < 0:
        raise ConfigError("scrape_interval_s must be > 0 and network_delay_s >= 0")
    opts = _Options(
        dict(policy_params or {}), seed, scrape_interval_s, network_delay_s, tuple(faults),
        keep_records, progress, slo, model, fast_forward, traces_dir, command, lora,
    )  # fmt: skip
    policy_obj = create_policy(policy, policy_params) if isinstance(policy, str) else policy
    run = _build(cluster, workload, policy_obj, opts)
    wall_s = run.sim.run()
    summary = run.metrics.summary(run.metrics.last_completion_s)
    timeseries = run.series.to_dict([b.backend_id for b in run.sim.backends])
    _add_backend_means(summary, timeseries)
    config = _config(cluster, run, policy_obj.name, opts)
    described = workload.describe()
    summary |= {
        "workload": described,
        "seed": seed,
        "workload_digest": run.digest.hexdigest(),
        "config": config,
        "config_hash": config_hash({"config": config, "workload": described}),
        "command": list(command) if command is not None else None,
        "versions": versions(),
        "backend_timeseries": timeseries,
        **_sim_keys(run.sim, wall_s),
        **_cache_and_pools(run),
        "demotions": _demotions(run.sim),
    }
    if run.sim.lora is not None:
        summary["lora"] = run.sim.lora.describe()
    if run.sim.disagg is not None:
        summary["disagg"] = run.sim.disagg.describe()
    tiers = kv_tier_summary(run.sim.backends)
    if tiers is not None:
        summary["kv_tiers"] = tiers
    return SimResult(summary, run.metrics.routing, run.metrics.records, timeseries)


@dataclass(frozen=True, slots=True)
class _Options:
    """``simulate``'s keyword arguments, carried together."""

    policy_params: dict[str, Any]
    seed: int
    scrape_interval_s: float
    network_delay_s: float
    faults: tuple[FaultEvent, ...]
    keep_records: bool
    progress: Callable[[int], None] | None
    slo: Slo | None
    model: str | None
    fast_forward: bool
    traces_dir: str | Path | None
    command: Sequence[str] | None
    lora: SimLoraSpec | None


@dataclass(slots=True)
class _Run:
    """A built simulation and what it reports into."""

    sim: Simulator
    metrics: MetricsCollector
    series: TimeSeries
    digest: WorkloadDigest
    infos: list[BackendInfo]


def _build(cluster: ClusterConfig, workload: Workload, policy: Policy, opts: _Options) -> _Run:
    infos = describe_backends(cluster)
    gateway_cfg = build_gateway_config(cluster, infos, opts.scrape_interval_s)
    # the engines that publish KV events live (kv_events_endpoint) publish here too
    publishers = {it.name for it in cluster.expanded() if it.spec.kv_events_endpoint}
    kv_events = SimKvEvents(gateway_cfg.block_size) if publishers else None
    backends = build_backends(
        cluster, fast_forward=opts.fast_forward, kv_events=kv_events, publishers=publishers
    )
    disagg = SimDisagg(backends) if cluster.has_pd_pools else None
    gateway = SimGateway(
        gateway_cfg, policy, backends, seed=opts.seed, kv_events=kv_events, disagg=disagg
    )
    ids = [b.backend_id for b in backends]
    metrics = MetricsCollector(ids, opts.slo, keep_records=opts.keep_records)
    metrics.has_kv_transfers = cluster.has_pd_pools
    series = TimeSeries(len(backends), SAMPLE_INTERVAL_S)
    digest = WorkloadDigest()
    sim = Simulator(
        backends,
        gateway,
        _digesting(iter(workload), digest),
        PromptIds(workload, opts.traces_dir, unread_for=BLOCK_SIZE),  # ids nobody reads: 0
        metrics,
        models=ModelPicker(dict(pool_gpu_shares(infos)), opts.model, opts.seed),
        network_delay_s=opts.network_delay_s,
        scrape_interval_s=opts.scrape_interval_s,
        faults=opts.faults,
        series=series,
        progress=opts.progress,
        lora=None if opts.lora is None else SimLora(opts.lora, gateway, backends, opts.seed),
        disagg=disagg,
    )
    return _Run(sim, metrics, series, digest, infos)


def _config(cluster: ClusterConfig, run: _Run, policy: str, opts: _Options) -> dict[str, Any]:
    """The run's ``config`` block (what the bench reports call the client config)."""
    return {
        "url": f"sim://{cluster.name}",
        "model": opts.model or "all (weighted by GPUs)",
        "endpoint": "completions",
        "arrival": {"mode": "open"},
        "policy": policy,
        "policy_params": opts.policy_params,
        "scrape_interval_s": opts.scrape_interval_s,
        "network_delay_s": opts.network_delay_s,
        "faults": [
            f"t={f.time_s},backend={f.backend},kind={f.kind},factor={f.factor}" for f in opts.faults
        ],
        "num_backends": len(run.infos),
        "num_gpus": sum(i.tp for i in run.infos),
    }


def _sim_keys(sim: Simulator, wall_s: float) -> dict[str, Any]:
    backends = sim.backends
    return {
        "sim_wall_s": wall_s,
        "sim_cpu_s": sim.cpu_s,
        "simulated_requests": sim.num_requests,
        "simulated_duration_s": sim.now_s,
        "arrival_span_s": sim.last_arrival_s,
        "real_time_factor": sim.now_s / wall_s if wall_s > 0 else None,
        "requests_per_wall_s": sim.num_requests / wall_s if wall_s > 0 else None,
        "sim_stats": {
            "num_events": sim.num_events,
            "num_steps": sum(b.num_steps for b in backends),
            "num_fused_steps": sum(b.num_fused_steps for b in backends),
        },
    }


def _cache_and_pools(run: _Run) -> dict[str, Any]:
    """The engines' own prefix-cache counters (hit rate in tokens, as vLLM's
    ``prefix_cache_hits / prefix_cache_queries``), each GPU pool's busy fraction (so an
    idle pool next to a queueing one shows), and the KV-event feeds' modes at the end."""
    sim = run.sim
    queries = hits = 0
    pools: dict[str, dict[str, float]] = {}
    for backend, info in zip(sim.backends, run.infos, strict=True):
        core = backend.core
        if core is not None:
            queries += core.prefix_cache_queries_tokens
            hits += core.prefix_cache_hits_tokens
        pool = pools.setdefault(info.gpu, {"num_backends": 0, "busy_s": 0.0})
        pool["num_backends"] += 1
        pool["busy_s"] += backend.busy_s
    duration_s = sim.now_s
    for pool in pools.values():
        denominator = pool["num_backends"] * duration_s
        pool["busy_fraction"] = pool["busy_s"] / denominator if denominator > 0 else 0.0
    events = sim.gateway.kv_events
    feeds = events.cache.feeds() if events is not None else []
    return {
        "prefix_cache": {
            "queries_tokens": queries,
            "hits_tokens": hits,
            "hit_rate": hits / queries if queries else None,
        },
        "pools": pools,
        "kv_events": {
            "publishers": len(feeds),
            "exact": sum(1 for f in feeds if f.mode == "exact"),
            "batches": sum(f.counters.batches for f in feeds),
            "events": sum(f.counters.events for f in feeds),
            "index_blocks": events.cache.index.num_blocks if events is not None else 0,
        },
    }


def _demotions(sim: Simulator) -> dict[str, Any]:
    """Slow-node demotions per backend (``sim.demotion``); enabled False when off."""
    demotion = sim.gateway.demotion
    if demotion is None:
        return {"enabled": False, "by_backend": {}}
    return {"enabled": True, "by_backend": dict(sorted(demotion.num_demotions.items()))}


def _digesting(specs: Iterator[RequestSpec], digest: WorkloadDigest) -> Iterator[RequestSpec]:
    for spec in specs:
        digest.add(spec)
        yield spec


def _add_backend_means(summary: dict[str, Any], timeseries: Mapping[str, Any]) -> None:
    """Mean utilisation and mean / max KV usage per backend into ``per_backend``."""
    per_backend = summary.get("per_backend")
    if not isinstance(per_backend, dict):
        return
    utilisation, kv_usage = timeseries["utilisation"], timeseries["kv_usage"]
    for backend, block in per_backend.items():
        u, kv = utilisation.get(backend), kv_usage.get(backend)
        if u:
            block["utilisation_mean"] = sum(u) / len(u)
        if kv:
            block["kv_usage_mean"] = sum(kv) / len(kv)
            block["kv_usage_max"] = max(kv)
