"""Glue between the gateway and the fault-tolerance state machines.

``Resilience`` owns the active prober (``prober.py``, verdicts by ``health.py``), the
passive outlier detector (``outlier.py``) and the slow-node demoter (``demotion.py``),
and writes their verdicts into the live ``BackendTable``:

* probe failures and ejections are *vetoes* (``table.set_veto``): the backend is
  unhealthy while any veto holds, whatever its scrapes say;
* demotion sets ``effective_weight`` = base x weight factor, which every policy reads.

With ``--workers N`` (``share``: ``routing.shared_verdicts``) each worker publishes its
probe, ejection and demotion verdicts and applies its siblings' at every tick: their
probe failures and ejections as the vetoes ``PEER_PROBE_VETO`` / ``PEER_EJECT_VETO``,
their demotions as the smaller weight factor. The outlier detector counts one run of
failures over all workers, and its ``max_ejection_percent`` counts the siblings'
ejections too; the demoter's windows take the siblings' TTFT and TPOT samples
(``on_sibling_sample``), so it judges all of the gateway's traffic. A half-open trial
stays the business of the worker that ejected the backend (its ``_is_trial_ready``
ignores the siblings' ejections, so two workers that both ejected a backend never wait
on each other).

It listens to every first token and finished attempt (the ``Router``'s
``first_token_listeners`` and ``completion_listeners``), runs a tick every
``_TICK_S`` (expired ejections turn half-open, demotion re-judged) and, through
``admit`` (the router's admit hook), puts a half-open backend first in one request's
ranked list: that request is its circuit-breaker trial, and if it fails the gateway's
retry sends it on to the next backend before any byte reached the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.metrics import PREFIX, GatewayMetrics
from kiloserve.gateway.resilience.demotion import SlowNodeDemoter
from kiloserve.gateway.resilience.health import ProbeTracker, wants_completion_probe
from kiloserve.gateway.resilience.outlier import OutlierDetector
from kiloserve.gateway.resilience.prober import COMPLETION_TIMEOUT, Prober
from kiloserve.policies.accounting import SAMPLE_TPOT, SAMPLE_TTFT
from kiloserve.policies.base import Outcome, RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.shared_verdicts import EJECT, PROBE, SharedVerdicts
from kiloserve.routing.table import BackendTable

__all__ = ["EJECT_VETO", "PEER_EJECT_VETO", "PEER_PROBE_VETO", "PROBE_VETO", "Resilience"]

logger = logging.getLogger(__name__)

PROBE_VETO = "probe"
EJECT_VETO = "ejected"
PEER_PROBE_VETO = "probe (another worker)"
PEER_EJECT_VETO = "ejected (another worker)"
_PROBE_VETOES = frozenset((PROBE_VETO, PEER_PROBE_VETO))
_TICK_S = 0.1


class Resilience:
    """Health probes, outlier ejection and demotion for one gateway app."""

    def __init__(self, cfg: GatewayConfig, router: Router, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.table: BackendTable = router.table
        self.outlier = OutlierDetector(cfg.outlier)
        self.demoter = SlowNodeDemoter(cfg.demotion)
        self.probes = ProbeTracker(cfg.health)
        self.num_probes: dict[tuple[str, str], int] = {}
        self.num_ejections: dict[str, int] = {}
        self.num_demotions: dict[tuple[str, str], int] = {}
        self.num_panics = 0
        self._base_weight: dict[str, float] = {}
        # when each backend last showed progress on real traffic (a first token, an ok
        # completion): a completion probe that timed out since then met a busy engine
        self._last_progress_s: dict[str, float] = {}
        self._prober: Prober | None = None
        self._task: asyncio.Task[None] | None = None
        self._share: SharedVerdicts | None = None
        # --workers N, a worker other than 0: True for a backend worker 0 probes now
        # (gateway/workers.py sets it), so the backends get one worker's probes, not N
        self.probed_elsewhere: Callable[[str], bool] | None = None
        self._peer_factor: dict[str, float] = {}
        router.admit = self.admit
        router.completion_listeners.append(self.on_complete)
        router.first_token_listeners.append(self.on_first_token)
        metrics.registry.register(_ResilienceCollector(self))

    @property
    def share(self) -> SharedVerdicts | None:
        """The sibling workers' verdicts and failure runs (gateway/workers.py sets it);
        None: one process."""
        return self._share

    @share.setter
    def share(self, share: SharedVerdicts | None) -> None:
        self._share = share
        self.outlier.streaks = share
        self.outlier.ejected_elsewhere = None if share is None else self._ejected_elsewhere

    def _ejected_elsewhere(self, backend_id: str) -> bool:
        rec = self.table.record_or_none(backend_id)
        return rec is not None and PEER_EJECT_VETO in rec.vetoes

    # -- traffic -------------------------------------------------------------------
    def on_complete(self, backend_id: str, info: RequestInfo, outcome: Outcome) -> None:
        now_s = time.monotonic()
        pool = self._pool_of(backend_id)
        if self.outlier.on_result(backend_id, outcome.status, now_s, pool):
            self.num_ejections[backend_id] = self.num_ejections.get(backend_id, 0) + 1
            self._veto(backend_id, EJECT_VETO, True)
        elif not self.outlier.is_ejected(backend_id):
            self._veto(backend_id, EJECT_VETO, False)
        if outcome.ok:
            self._last_progress_s[backend_id] = now_s
            self.demoter.observe(backend_id, now_s, None, outcome.tpot_ms)

    def on_first_token(self, backend_id: str, info: RequestInfo, ttft_ms: float) -> None:
        """TTFT samples count at the first token: a slow node shows before it finishes."""
        now_s = time.monotonic()
        self._last_progress_s[backend_id] = now_s
        self.demoter.observe(backend_id, now_s, ttft_ms, None)

    def on_sibling_sample(self, backend_id: str, kind: int, value: float) -> None:
        """A sibling worker's TTFT or TPOT sample (``SharedLoad.on_sample``): the
        demoter judges every worker's traffic, as one process would (before, each judged
        its own share, so with N workers a slow node took N times the samples to show).
        A sibling's TPOT samples include attempts that failed after their tokens (the
        sample channel does not say which), which this worker's own exclude."""
        now_s = time.monotonic()
        if kind == SAMPLE_TTFT:
            self._last_progress_s[backend_id] = now_s  # a busy engine, not a hung one
            self.demoter.observe(backend_id, now_s, value, None)
        elif kind == SAMPLE_TPOT:
            self.demoter.observe(backend_id, now_s, None, value)

    def admit(self, ranked: tuple[str, ...], pool: frozenset[str]) -> tuple[str, ...]:
        """Put one half-open backend of ``pool`` first (its trial request), if any; with
        nothing routable, fall back to the backends that only failed probes (panic)."""
        if not ranked:
            ranked = self._panic(pool)
        for backend_id in sorted(pool):
            is_candidate = backend_id not in ranked and self._is_trial_ready(backend_id)
            if is_candidate and self.outlier.try_trial(backend_id):
                logger.info("backend %s half-open: one trial request", backend_id)
                return (backend_id, *ranked)
        return ranked

    def _panic(self, pool: frozenset[str]) -> tuple[str, ...]:
        """Envoy's panic routing: when probes failed every backend of a pool (an
        overloaded box, a probe path problem), trust traffic and retries over probes."""
        table = self.table
        fallback = [
            b for b in pool
            if table.record(b).vetoes and table.record(b).vetoes <= _PROBE_VETOES
            and table.record(b).is_scrape_healthy
            and not table.state(b).draining
        ]  # fmt: skip
        fallback.sort(key=lambda b: table.state(b).in_flight)
        if fallback:
            self.num_panics += 1
            if self.num_panics == 1 or self.num_panics % 1000 == 0:
                logger.warning("panic routing: every backend of %s failed its probes", sorted(pool))
        return tuple(fallback)

    def _is_trial_ready(self, backend_id: str) -> bool:
        rec = self.table.record(backend_id)
        others = rec.vetoes - {EJECT_VETO, PEER_EJECT_VETO}
        return not others and rec.is_scrape_healthy and not rec.state.draining

    def _pool_of(self, backend_id: str) -> frozenset[str]:
        ids: set[str] = set()
        if backend_id in self.table.backend_ids():
            for model in self.table.state(backend_id).models:
                ids |= self.table.pool_ids(model)
        return frozenset(ids)

    # -- probes --------------------------------------------------------------------
    def _target(self, backend_id: str) -> tuple[str, str | None] | None:
        """(url, the model of its completion probe: None when it gets none)."""
        if backend_id not in self.table.backend_ids():
            return None
        rec = self.table.record(backend_id)
        s = rec.state
        engine = rec.config.engine if rec.config.engine != "auto" else rec.engine
        is_on = wants_completion_probe(self.cfg.health.completion_probe, engine)
        return s.url, min(s.models) if s.models and is_on else None

    def _on_probe(self, backend_id: str, is_ok: bool, why: str, started_s: float) -> None:
        if why == COMPLETION_TIMEOUT and self._last_progress_s.get(backend_id, -1.0) >= started_s:
            # real requests made progress on it meanwhile: busy (a long queue), not hung;
            # counting this would eject loaded backends one after another (a cascade)
            key = (backend_id, "busy")
            self.num_probes[key] = self.num_probes.get(key, 0) + 1
            return
        key = (backend_id, "ok" if is_ok else "fail")
        self.num_probes[key] = self.num_probes.get(key, 0) + 1
        changed = self.probes.record(backend_id, is_ok)
        if not is_ok:
            self.table.set_probe_failure(backend_id, why)
        elif self.probes.is_healthy(backend_id):  # kept while the probes hold it out
            self.table.set_probe_failure(backend_id, "")
        if is_ok and self.outlier.on_probe_success(backend_id, time.monotonic()):
            self._veto(backend_id, EJECT_VETO, False)
        if changed is False:
            logger.warning("backend %s failed its health probes (%s)", backend_id, why)
            self._veto(backend_id, PROBE_VETO, True)
        elif changed is True:
            logger.info("backend %s passes its health probes again", backend_id)
            self._veto(backend_id, PROBE_VETO, False)

    def _probed_elsewhere(self, backend_id: str) -> bool:
        """True while another worker (worker 0) probes ``backend_id`` for this one; its
        verdict then stands for this worker's own probe: while it passes (no sibling
        reports a probe failure), a half-open breaker of this worker closes as on a
        passing probe of its own. Without this, an ejection by a worker that does not
        probe stayed half-open until that worker's next request, held out by every
        worker meanwhile: with no traffic, or with little, for good. Likewise a probe
        failure this worker found while it probed for itself (worker 0's scrape had gone
        stale): it is dropped once worker 0's probes of the backend pass, or it held the
        backend out of every worker for good (a fresh-clone CI run of the real failover
        test: a healthy vLLM out for minutes)."""
        if self.probed_elsewhere is None or not self.probed_elsewhere(backend_id):
            return False
        rec = self.table.record_or_none(backend_id)
        passing = rec is not None and PEER_PROBE_VETO not in rec.vetoes
        if passing and self.outlier.on_probe_success(backend_id, time.monotonic()):
            self._veto(backend_id, EJECT_VETO, False)
        if passing and rec is not None and PROBE_VETO in rec.vetoes:
            # this worker's own verdict from when it probed for itself (worker 0 was
            # silent) would never be probed again: worker 0's passing one stands
            logger.info("backend %s passes worker 0's probes: this worker's verdict dropped",
                        backend_id)  # fmt: skip
            self.probes.forget(backend_id)
            self.table.set_probe_failure(backend_id, "")
            self._veto(backend_id, PROBE_VETO, False)
        return True

    # -- verdicts shared with sibling workers -----------------------------------------
    def _veto(self, backend_id: str, reason: str, is_on: bool) -> None:
        self.table.set_veto(backend_id, reason, is_on)
        self._publish(backend_id, time.monotonic())

    def _publish(self, backend_id: str, now_s: float) -> None:
        rec = self.table.record_or_none(backend_id)
        if self.share is None or rec is None:
            return
        flags = (PROBE if PROBE_VETO in rec.vetoes else 0) | (
            EJECT if EJECT_VETO in rec.vetoes else 0
        )
        self.share.publish(backend_id, flags, self.demoter.weight_factor(backend_id, now_s))

    def _apply_peers(self, ids: list[str]) -> None:
        """The siblings' probe failures and ejections as vetoes, their demotions as
        weight factors (``_apply_weight``)."""
        if self.share is None or not self.share.changed():
            return
        for b, (flags, factor) in self.share.peers(ids).items():
            self.table.set_veto(b, PEER_PROBE_VETO, bool(flags & PROBE))
            self.table.set_veto(b, PEER_EJECT_VETO, bool(flags & EJECT))
            self._peer_factor[b] = factor

    # -- ticks ---------------------------------------------------------------------
    def tick(self, now_s: float) -> None:
        self.outlier.tick(now_s)
        self.table.sync()  # the siblings' samples reach the demoter while this one idles
        ids = self.table.backend_ids()
        self._apply_peers(ids)
        # compare only with healthy peers: a just-restarted or ejected one is no yardstick
        healthy = {b for b in ids if self.table.state(b).healthy}
        pools = {b: (self._pool_of(b) & healthy) | {b} for b in ids}
        for event in self.demoter.evaluate(now_s, pools):
            if event.reason:
                key = (event.backend_id, event.reason)
                self.num_demotions[key] = self.num_demotions.get(key, 0) + 1
                logger.warning(
                    "backend %s demoted to weight x%.2f: %s %.0f ms > %.0f ms; consider "
                    "restarting it or scaling out",
                    event.backend_id, self.cfg.demotion.demoted_weight, event.reason,
                    event.value_ms, event.threshold_ms,
                )  # fmt: skip
            else:
                logger.info(
                    "backend %s back under its latency thresholds: slow start", event.backend_id
                )
        for b in ids:
            self._apply_weight(b, now_s)
            self._publish(b, now_s)

    def reset_weight(self, backend_id: str) -> None:
        """The backend's configured weight changed: its health factor starts again
        from 1.0 at the next tick (any demotion factor still applies; policies multiply
        the configured weight by it)."""
        self._base_weight.pop(backend_id, None)
        state = self.table.state_or_none(backend_id)
        if state is not None:
            state.effective_weight = 1.0

    def _apply_weight(self, backend_id: str, now_s: float) -> None:
        state = self.table.state(backend_id)
        base = self._base_weight.setdefault(backend_id, state.effective_weight)
        factor = self.demoter.weight_factor(backend_id, now_s)
        state.effective_weight = base * min(factor, self._peer_factor.get(backend_id, 1.0))

    async def _run(self) -> None:
        while True:
            try:
                self.tick(time.monotonic())
                if self._prober is not None:
                    self._prober.reconcile(set(self.table.backend_ids()))
                self._forget_gone()
            except Exception:  # keep ticking whatever one round did
                logger.exception("fault-tolerance tick failed")
            await asyncio.sleep(_TICK_S)

    def _forget_gone(self) -> None:
        gone = self._base_weight.keys() - set(self.table.backend_ids())
        for b in gone:
            self._base_weight.pop(b, None)
            self._last_progress_s.pop(b, None)
            self._peer_factor.pop(b, None)
            self.outlier.forget(b)
            self.demoter.forget(b)

    def start(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        if self.cfg.health.enabled:
            self._prober = Prober(self.cfg.health, session, self._target, self._on_probe, rng)
            self._prober.tracker = self.probes
            self._prober.skip = self._probed_elsewhere
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._prober is not None:
            await self._prober.close()

    def describe(self, backend_id: str, now_s: float) -> dict[str, Any]:
        return {
            **self.outlier.describe(backend_id, now_s),
            **self.demoter.describe(backend_id),
            "probe_healthy": self.probes.is_healthy(backend_id),
            "sibling_weight_factor": self._peer_factor.get(backend_id, 1.0),
        }


class _ResilienceCollector(Collector):
    def __init__(self, r: Resilience) -> None:
        self._r = r

    def collect(self) -> Iterator[Any]:
        r = self._r
        probes = CounterMetricFamily(
            PREFIX + "health_probes", "active health probes", labels=["backend", "result"]
        )
        for (b, result), n in sorted(r.num_probes.items()):
            probes.add_metric([b, result], n)
        ejections = CounterMetricFamily(
            PREFIX + "outlier_ejections", "passive outlier ejections", labels=["backend"]
        )
        for b, n in sorted(r.num_ejections.items()):
            ejections.add_metric([b], n)
        demotions = CounterMetricFamily(
            PREFIX + "demotions", "slow-node demotions", labels=["backend", "reason"]
        )
        for (b, reason), n in sorted(r.num_demotions.items()):
            demotions.add_metric([b, reason], n)
        ejected = GaugeMetricFamily(
            PREFIX + "backend_ejected", "1 while ejected or half-open", labels=["backend"]
        )
        demoted = GaugeMetricFamily(
            PREFIX + "backend_demoted", "1 while demoted or in slow start", labels=["backend"]
        )
        for b in r.table.backend_ids():
            ejected.add_metric([b], 1.0 if r.outlier.is_ejected(b) else 0.0)
            demoted.add_metric([b], 1.0 if r.demoter.describe(b)["demoted"] else 0.0)
        panics = CounterMetricFamily(
            PREFIX + "panic_routing", "requests routed to probe-failed backends (all failed)"
        )
        panics.add_metric([], r.num_panics)
        yield from (probes, ejections, demotions, ejected, demoted, panics)
