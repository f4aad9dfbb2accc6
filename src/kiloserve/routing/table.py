"""The backend table: one ``BackendState`` per backend, and snapshots of it.

The live gateway and the simulator both keep one (the gateway fills its scraped
fields from HTTP scrapes, the simulator from its simulated engines).

Everything the gateway knows about a backend lives here and only here: static fields
from config, models (configured or discovered), scraped engine metrics, live counters
updated at dispatch / first token / completion, EWMAs of TTFT and TPOT, and health.

Health rule (basic; a later issue adds active probes and outlier ejection here): a
backend whose scrapes fail ``max_scrape_failures`` times in a row (connect error,
timeout, 5xx) is unhealthy; one successful scrape makes it healthy again. A backend
with no ``/metrics`` page (4xx) counts as reachable with unknown load. Scraped values
older than ``stale_after_s`` are cleared to ``None`` (unknown) and ``scrape_stale`` is
set, so policies never read a stale backend as idle.

Node health (``BackendConfig.node_metrics_url``, ``routing/node_metrics.py``): the
node page's PCIe load replaces the engine page's ``pcie_util``, and an Xid, an
uncorrectable ECC error or an overheated GPU holds the backend unhealthy (veto
``node``) until the page is clean again; a failed node scrape forgets the node
signals (the engine scrape alone decides reachability).

Snapshots share the live ``BackendState`` objects (no copy per request): policies
choose synchronously, so nothing changes during one decision, and they must not
mutate what they see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kiloserve.catalog.loader import get_gpu
from kiloserve.errors import CatalogError, NotFoundError
from kiloserve.policies.accounting import (
    EWMA_ALPHA,
    SAMPLE_PREFILL_WORK,
    SAMPLE_TPOT,
    SAMPLE_TTFT,
    note_complete,
    note_dispatch,
    note_first_token,
)
from kiloserve.policies.base import BackendState, ClusterSnapshot, Outcome, RequestInfo
from kiloserve.routing.config import BackendConfig

if TYPE_CHECKING:
    from kiloserve.kvevents.feed import KvEventCache
    from kiloserve.routing.engine_metrics import EngineMetrics
    from kiloserve.routing.node_metrics import NodeMetrics

__all__ = [
    "EWMA_ALPHA",
    "BackendRecord",
    "BackendTable",
    "LoadShare",
    "TableSettings",
    "prefill_capability",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BackendRecord:
    """A backend's live state plus the bookkeeping the table needs about it."""

    config: BackendConfig
    state: BackendState
    engine: str | None = None
    last_scrape_ok_s: float | None = None
    num_scrape_failures: int = 0
    num_scrape_errors_total: int = 0
    last_scrape_error: str = ""
    is_scrape_healthy: bool = True
    vetoes: set[str] = field(default_factory=set)  # fault-tolerance reasons to stay unhealthy
    probe_failure: str = ""  # why the active probes last failed ("" once they pass again)
    is_removing: bool = False  # left the registry; deleted once its in-flight requests end
    # the engine's own cumulative prefix-cache counters (tokens) as last scraped; kept
    # through failed scrapes; None when the engine does not report them
    prefix_queries_tokens: float | None = None
    prefix_hits_tokens: float | None = None
    # engine kind and version, model root, max_model_len, cache config, as the engine
    # itself reports them (gateway/inventory.py, SPEC S5.5); empty until collected
    inventory: dict[str, Any] = field(default_factory=dict)
    node: NodeMetrics | None = None  # the node page as last scraped (None: none / failed)
    node_problems: list[str] = field(default_factory=list)

    @property
    def is_discovered(self) -> bool:
        return bool(self.state.models)

    @property
    def needs_discovery(self) -> bool:
        return not self.config.models


def prefill_capability(gpu: str, tp: int = 1) -> float | None:
    """A replica's effective prefill TFLOPS: the catalog GPU's dense BF16 TFLOPS x
    prefill MFU x ``tp`` (``GpuSpec.prefill_tflops``); None when ``gpu`` is empty or not
    in the built-in catalog. The ``ttft`` scorer scales known prefill speeds by it."""
    if not gpu:
        return None
    try:
        spec = get_gpu(gpu)
    except CatalogError:
        return None
    return spec.prefill_tflops * tp


def _new_state(cfg: BackendConfig) -> BackendState:
    return BackendState(
        backend_id=cfg.backend_id,
        url=cfg.url.rstrip("/"),
        models=frozenset(cfg.models),
        gpu=cfg.gpu,
        group=cfg.group,
        version=cfg.version,
        cost_per_hour=cfg.cost_per_hour,
        weight=cfg.weight,
        effective_weight=1.0,  # the health factor; policies multiply by weight
        kv_capacity_tokens=cfg.kv_capacity_tokens,
        role=cfg.role,
        prefill_capability=prefill_capability(cfg.gpu, cfg.tp),
        scrape_stale=True,
    )


class TableSettings(Protocol):
    """What the table reads of a configuration (``GatewayConfig`` has all of it)."""

    @property
    def backends(self) -> Sequence[BackendConfig]: ...

    @property
    def stale_after_s(self) -> float: ...

    @property
    def max_scrape_failures(self) -> int: ...


class LoadShare(Protocol):
    """Load shared with other routers of the same backends (``routing.shared_load``:
    the gateway's worker processes). The table publishes the exact change its own
    accounting made, and the samples its EWMAs learned from; ``pull`` adds the peers'
    changes to the table's states and feeds their samples to its EWMAs."""

    def publish(self, backend_id: str, deltas: tuple[int, ...]) -> None: ...

    def publish_sample(self, backend_id: str, kind: int, value: float) -> None:
        """A sample this router learned from (``policies.accounting.SAMPLE_*``); the
        peers feed it to their own EWMAs (``accounting.note_sample``)."""
        ...

    def pull(self, state_of: Callable[[str], BackendState | None]) -> None: ...

    def resync(self, state_of: Callable[[str], BackendState | None]) -> None: ...

    @property
    def num_resyncs(self) -> int:
        """How often the counters were rebuilt (absolute values, not changes)."""
        ...

    def set_draining(self, backend_id: str, draining: bool) -> None: ...


def _load(s: BackendState) -> tuple[int, int, int, int, int, int]:
    """The counters shared with peer routers (``routing.shared_load.FIELDS``)."""
    return (
        s.in_flight,
        s.outstanding_prefill_tokens,
        s.outstanding_decode_tokens,
        s.admitted_in_flight,
        s.reserved_tokens,
        s.undispatched_tokens,
    )


class BackendTable:
    """Live state of every configured backend, keyed by backend id.

    It holds state only: who is told of a first token or a finished request is the
    ``Router``'s business (``kiloserve.routing.router``).
    """

    def __init__(self, cfg: TableSettings) -> None:
        self._stale_after_s = cfg.stale_after_s
        self._max_scrape_failures = cfg.max_scrape_failures
        self._records: dict[str, BackendRecord] = {
            b.backend_id: BackendRecord(config=b, state=_new_state(b)) for b in cfg.backends
        }
        self._states: tuple[BackendState, ...] = tuple(r.state for r in self._records.values())
        self._pools: dict[str, tuple[BackendState, ...]] = {}
        self._pool_ids: dict[str, frozenset[str]] = {}
        self.has_roles = False  # a prefill- or decode-role backend exists (routing/disagg.py)
        self._rebuild_pools()
        # the engines' prefix caches from KV events (set by the gateway or simulator
        # when backends publish them); every snapshot carries it to the policy
        self.kv_cache: KvEventCache | None = None
        # the in-flight view shared with peer routers (gateway workers); None: this
        # table is the only router of its backends
        self.shared: LoadShare | None = None

    # -- lookup --------------------------------------------------------------------
    def backend_ids(self) -> list[str]:
        return list(self._records)

    def record(self, backend_id: str) -> BackendRecord:
        rec = self._records.get(backend_id)
        if rec is None:
            raise NotFoundError(f"unknown backend '{backend_id}'", code="backend_not_found")
        return rec

    def record_or_none(self, backend_id: str) -> BackendRecord | None:
        return self._records.get(backend_id)

    def state(self, backend_id: str) -> BackendState:
        return self.record(backend_id).state

    def state_or_none(self, backend_id: str) -> BackendState | None:
        rec = self._records.get(backend_id)
        return None if rec is None else rec.state

    def sync(self) -> None:
        """Take in the peers' load changes (``shared``); a no-op without peers."""
        if self.shared is not None:
            self.shared.pull(self.state_or_none)

    def url_of(self, backend_id: str) -> str:
        return self.record(backend_id).state.url

    def served_models(self) -> list[str]:
        return sorted(self._pools)

    def serves(self, model: str) -> bool:
        return model in self._pools

    def pool_ids(self, model: str) -> frozenset[str]:
        return self._pool_ids.get(model, frozenset())

    def is_routable(self, backend_id: str) -> bool:
        rec = self._records.get(backend_id)
        return rec is not None and rec.state.is_routable

    def snapshot(
        self,
        now_s: float,
        eligible_by_model: dict[str, tuple[BackendState, ...]] | None = None,
    ) -> ClusterSnapshot:
        """A view for one decision (live states; pools precomputed; candidates too when
        the caller tracks every health change: ``ClusterSnapshot.eligible_by_model``)."""
        return ClusterSnapshot(
            now_s=now_s,
            backends=self._states,
            _by_model=dict(self._pools),
            eligible_by_model=eligible_by_model,
            kv_cache=self.kv_cache,
        )

    def is_ready(self) -> bool:
        """True when at least one backend with known models is routable and reachable."""
        return any(
            r.state.is_routable and r.is_discovered and r.last_scrape_ok_s is not None
            for r in self._records.values()
        )

    # -- models --------------------------------------------------------------------
    def set_models(self, backend_id: str, models: Iterable[str]) -> None:
        state = self.state(backend_id)
        new = frozenset(models)
        if new != state.models:
            logger.info("backend %s serves models %s", backend_id, sorted(new))
            state.models = new
            self._rebuild_pools()

    def _rebuild_pools(self) -> None:
        self._states = tuple(r.state for r in self._records.values())
        pools: dict[str, list[BackendState]] = {}
        for s in self._states:
            for m in s.models:
                pools.setdefault(m, []).append(s)
        self._pools = {m: tuple(v) for m, v in pools.items()}
        self._pool_ids = {m: frozenset(s.backend_id for s in v) for m, v in pools.items()}
        self.has_roles = any(s.role != "both" for s in self._states)

    def role_of(self, backend_id: str) -> str:
        """The backend's role (prefill, decode or both); ``both`` when unknown."""
        rec = self._records.get(backend_id)
        return "both" if rec is None else rec.state.role

    def pool(self, model: str) -> tuple[BackendState, ...]:
        """Every backend serving ``model`` (healthy or not), in table order."""
        return self._pools.get(model, ())

    # -- live counters (hot path) --------------------------------------------------
    def on_dispatch(self, backend_id: str, info: RequestInfo) -> None:
        state = self._records[backend_id].state
        before = _load(state) if self.shared is not None else None
        work = note_dispatch(state, info)
        if before is not None:
            self._publish(state, before)
            self._share_sample(backend_id, SAMPLE_PREFILL_WORK, work)
        if self.kv_cache is not None:
            self.kv_cache.in_flight.add(backend_id, info.prefix_hashes)

    def on_first_token(self, backend_id: str, info: RequestInfo, ttft_ms: float) -> None:
        rec = self._records.get(backend_id)
        if rec is not None:
            before = _load(rec.state) if self.shared is not None else None
            note_first_token(rec.state, info, ttft_ms)
            if before is not None:
                self._publish(rec.state, before)
                self._share_sample(backend_id, SAMPLE_TTFT, ttft_ms)

    def on_complete(
        self, backend_id: str, info: RequestInfo, outcome: Outcome, *, had_first_token: bool
    ) -> None:
        if self.kv_cache is not None:
            self.kv_cache.in_flight.remove(backend_id, info.prefix_hashes)
        rec = self._records.get(backend_id)
        if rec is None:
            return
        before = _load(rec.state) if self.shared is not None else None
        note_complete(rec.state, info, outcome, had_first_token=had_first_token)
        if before is not None:
            self._publish(rec.state, before)
            if outcome.tpot_ms is not None:
                self._share_sample(backend_id, SAMPLE_TPOT, outcome.tpot_ms)
        if rec.is_removing and rec.state.in_flight == 0:
            self._delete(backend_id)

    def adjust_admission(
        self, backend_id: str, *, in_flight: int = 0, reserved: int = 0, undispatched: int = 0
    ) -> None:
        """Change the admission controller's counts for a backend (never below zero)."""
        s = self.state_or_none(backend_id)
        if s is None:
            return
        before = _load(s) if self.shared is not None else None
        s.admitted_in_flight = max(0, s.admitted_in_flight + in_flight)
        s.reserved_tokens = max(0, s.reserved_tokens + reserved)
        s.undispatched_tokens = max(0, s.undispatched_tokens + undispatched)
        if before is not None:
            self._publish(s, before)

    def _publish(self, state: BackendState, before: tuple[int, ...]) -> None:
        """Hand ``shared`` the change the accounting just made (after minus before)."""
        deltas = tuple(a - b for a, b in zip(_load(state), before, strict=True))
        if self.shared is not None and any(deltas):
            self.shared.publish(state.backend_id, deltas)

    def _share_sample(self, backend_id: str, kind: int, value: float) -> None:
        if self.shared is not None:
            self.shared.publish_sample(backend_id, kind, value)

    # -- dynamic membership (registry) ---------------------------------------------
    def add_backend(self, cfg: BackendConfig) -> None:
        """Add a backend, or update the static fields of a known one (same id)."""
        rec = self._records.get(cfg.backend_id)
        if rec is None:
            self._records[cfg.backend_id] = BackendRecord(config=cfg, state=_new_state(cfg))
            logger.info("backend %s added (%s)", cfg.backend_id, cfg.url)
            if self.shared is not None:  # what peers already count there
                self.shared.resync(self.state_or_none)
        else:
            s, new = rec.state, _new_state(cfg)
            s.url, s.models, s.gpu, s.group = new.url, new.models, new.gpu, new.group
            s.version, s.cost_per_hour, s.weight = new.version, new.cost_per_hour, new.weight
            s.role, s.prefill_capability = new.role, new.prefill_capability
            rec.config = cfg
            if rec.is_removing:
                rec.is_removing, s.draining = False, False
        self._rebuild_pools()

    def remove_backend(self, backend_id: str) -> None:
        """Stop routing to a backend; it is deleted once its in-flight requests end."""
        rec = self._records.get(backend_id)
        if rec is None:
            return
        if rec.state.in_flight == 0:
            self._delete(backend_id)
            return
        rec.is_removing = True
        rec.state.draining = True
        logger.info("backend %s removing after %d in-flight", backend_id, rec.state.in_flight)

    def _delete(self, backend_id: str) -> None:
        del self._records[backend_id]
        self._rebuild_pools()
        logger.info("backend %s removed", backend_id)

    # -- fault-tolerance vetoes ----------------------------------------------------
    def set_veto(self, backend_id: str, reason: str, is_on: bool) -> None:
        """Hold a backend unhealthy for ``reason`` (active probe, outlier ejection)."""
        rec = self._records.get(backend_id)
        if rec is None:
            return
        if is_on:
            rec.vetoes.add(reason)
        else:
            rec.vetoes.discard(reason)
        self._apply_health(rec)

    def set_probe_failure(self, backend_id: str, why: str) -> None:
        """Record why the active probes failed (``""``: they pass again)."""
        rec = self._records.get(backend_id)
        if rec is not None:
            rec.probe_failure = why

    @staticmethod
    def _apply_health(rec: BackendRecord) -> None:
        healthy = rec.is_scrape_healthy and not rec.vetoes
        if healthy != rec.state.healthy:
            rec.state.healthy = healthy
            vetoes = ", ".join(sorted(rec.vetoes)) or "scrapes"
            why = "healthy" if healthy else f"unhealthy ({vetoes})"
            logger.info("backend %s %s", rec.state.backend_id, why)

    # -- scrapes and health --------------------------------------------------------
    def record_scrape(self, backend_id: str, metrics: EngineMetrics, now_s: float) -> None:
        rec = self.record(backend_id)
        s = rec.state
        s.num_running = metrics.num_running
        s.num_waiting = metrics.num_waiting
        s.kv_usage = metrics.kv_usage
        s.prefix_hit_rate = metrics.prefix_hit_rate
        node_pcie = None if rec.node is None else rec.node.pcie_util
        s.pcie_util = metrics.pcie_util if node_pcie is None else node_pcie
        s.scrape_stale = False
        rec.engine = metrics.engine or rec.engine
        rec.prefix_queries_tokens = metrics.prefix_queries_tokens
        rec.prefix_hits_tokens = metrics.prefix_hits_tokens
        rec.last_scrape_ok_s = now_s
        self._scrape_succeeded(rec)

    def record_scrape_unavailable(self, backend_id: str, now_s: float) -> None:
        """The backend answered but has no metrics page: reachable, load unknown."""
        rec = self.record(backend_id)
        rec.last_scrape_ok_s = now_s
        self._clear_scraped(rec.state)
        self._scrape_succeeded(rec)

    def record_scrape_failure(self, backend_id: str, now_s: float, reason: str) -> None:
        rec = self.record(backend_id)
        rec.num_scrape_failures += 1
        rec.num_scrape_errors_total += 1
        rec.last_scrape_error = reason
        if rec.is_scrape_healthy and rec.num_scrape_failures >= self._max_scrape_failures:
            rec.is_scrape_healthy = False
            self._apply_health(rec)
            logger.warning(
                "backend %s unhealthy after %d failed scrapes (%s)",
                backend_id,
                rec.num_scrape_failures,
                reason,
            )

    def _scrape_succeeded(self, rec: BackendRecord) -> None:
        rec.num_scrape_failures = 0
        if not rec.is_scrape_healthy:
            rec.is_scrape_healthy = True
            self._apply_health(rec)
            logger.info("backend %s scrapes healthy again", rec.state.backend_id)

    def record_node(
        self, backend_id: str, node: NodeMetrics | None, problems: Sequence[str] = ()
    ) -> None:
        """The node page's signals (``None``: its scrape failed) and health verdict."""
        rec = self._records.get(backend_id)
        if rec is None:
            return
        rec.node = node
        if node is not None and node.pcie_util is not None and not rec.state.scrape_stale:
            rec.state.pcie_util = node.pcie_util
        if list(problems) != rec.node_problems:
            rec.node_problems = list(problems)
            if problems:
                logger.warning("backend %s node unhealthy: %s", backend_id, ", ".join(problems))
            else:
                logger.info("backend %s node healthy", backend_id)
        self.set_veto(backend_id, "node", bool(problems))

    def refresh_staleness(self, now_s: float) -> None:
        for rec in self._records.values():
            last = rec.last_scrape_ok_s
            if last is None or now_s - last > self._stale_after_s:
                self._clear_scraped(rec.state)

    @staticmethod
    def _clear_scraped(s: BackendState) -> None:
        s.num_running = s.num_waiting = None
        s.kv_usage = s.prefix_hit_rate = s.pcie_util = None
        s.scrape_stale = True

    def set_inventory(self, backend_id: str, inventory: dict[str, Any]) -> None:
        """What the engine runs (``gateway/inventory.py``): replaces the last one."""
        self.record(backend_id).inventory = inventory

    # -- admin ---------------------------------------------------------------------
    def set_draining(self, backend_id: str, draining: bool) -> None:
        self.state(backend_id).draining = draining
        if self.shared is not None:
            self.shared.set_draining(backend_id, draining)
        logger.info("backend %s %s", backend_id, "draining" if draining else "undrained")

    def describe(self, now_s: float) -> list[dict[str, Any]]:
        """Live state of every backend, JSON-ready (for ``GET /admin/backends``)."""
        self.sync()
        return [self._describe_one(r, now_s) for r in self._records.values()]

    @staticmethod
    def _describe_one(rec: BackendRecord, now_s: float) -> dict[str, Any]:
        s = rec.state
        age = None if rec.last_scrape_ok_s is None else round(now_s - rec.last_scrape_ok_s, 3)
        reasons = sorted(rec.vetoes) + ([] if rec.is_scrape_healthy else ["scrapes"])
        return {
            "name": s.backend_id,
            "url": s.url,
            "models": sorted(s.models),
            "engine": rec.engine or rec.inventory.get("engine") or rec.config.engine,
            "engine_version": rec.inventory.get("engine_version", ""),
            "model_root": rec.inventory.get("model_root", ""),
            "max_model_len": rec.inventory.get("max_model_len"),
            "cache_config": rec.inventory.get("cache_config", {}),
            "gpu": s.gpu,
            "group": s.group,
            "role": s.role,
            "version": s.version,
            "cost_per_hour": s.cost_per_hour,
            "weight": s.weight,
            "effective_weight": s.effective_weight,
            "healthy": s.healthy,
            "unhealthy_reasons": reasons,
            "probe_failure": rec.probe_failure,
            "draining": s.draining,
            "routable": s.is_routable,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_usage": s.kv_usage,
            "prefix_hit_rate": s.prefix_hit_rate,
            "pcie_util": s.pcie_util,
            "node": None if rec.node is None else rec.node.to_json(),
            "node_problems": rec.node_problems,
            "scrape_stale": s.scrape_stale,
            "scrape_age_s": age,
            "num_scrape_errors_total": rec.num_scrape_errors_total,
            "last_scrape_error": rec.last_scrape_error,
            "in_flight": s.in_flight,
            "outstanding_prefill_tokens": s.outstanding_prefill_tokens,
            "outstanding_decode_tokens": s.outstanding_decode_tokens,
            "ewma_ttft_ms": s.ewma_ttft_ms,
            "ewma_tpot_ms": s.ewma_tpot_ms,
            "consecutive_errors": s.consecutive_errors,
        }
