"""The doctor's rules: pure functions from a collected snapshot to ranked findings.

No I/O, no clock: ``probe.py`` reads the gateway and the engines and builds a
``Snapshot`` (``facts_from_reads`` turns its raw reads into ``BackendFacts``); each rule
here looks at the snapshot and returns findings with a score in ``[0, 1]``;
``diagnose`` ranks them, most probable first. The thresholds are the ``THRESHOLDS``
below and are stated in docs/doctor.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiloserve.routing.engine_metrics import parse_samples

__all__ = [
    "CAUSES",
    "THRESHOLDS",
    "BackendFacts",
    "EngineRead",
    "Finding",
    "Snapshot",
    "diagnose",
    "engine_read",
    "facts_from_reads",
    "gateway_counts",
    "parse_prometheus",
]

# cause -> what to do (the advice column)
CAUSES: dict[str, str] = {
    "engine_down": "the engine does not accept connections: check its process and logs "
    "(crash, OOM kill), restart it; the gateway routes around it meanwhile",
    "hung_engine": "the engine accepts connections but does not answer or make progress: "
    "take a stack dump / check GPU health (nvidia-smi, Xid errors), drain and restart it",
    "error_burst": "the backend answers 5xx: read its log for the error, drain it "
    "(POST /admin/backends/NAME/drain) until fixed; check the model and GPU",
    "slow_node": "the engine's own steps are slower than its pool's: check GPU clocks, "
    "thermal throttling, noisy neighbours, a wrong TP/quant; drain it if it persists",
    "kv_saturation": "the KV cache is full (preemptions): lower max_num_seqs or "
    "max_model_len, cap max_tokens, or add replicas; enable admission's KV budget",
    "network_delay": "the engine itself is fast but the round trip to it is slow: check "
    "the network path (MTU, congestion, cross-zone hops, a proxy) between gateway and node",
    "queue_buildup": "requests queue across the whole pool: the pool is short of "
    "capacity for this load; add replicas or lower the load (rate limits, admission)",
    "pool_short": "one model's pool is saturated while another pool idles: move "
    "replicas between pools (kiloserve plan) or scale this model's pool",
}

THRESHOLDS: dict[str, float] = {
    "slow_ratio": 2.0,  # a backend's latency / its pool's median (of the others)
    "slow_min_ms": 5.0,  # ... and above this absolute floor
    "error_share": 0.10,  # 5xx share of the gateway's attempts in the window
    "error_min": 3,  # ... with at least this many errors
    "consecutive_errors": 3,
    "kv_high": 0.90,  # kv_cache_usage at or above this
    "rtt_ratio": 3.0,  # round trip / the pool's median round trip
    "rtt_min_ms": 30.0,  # ... and above this absolute floor
    "waiting_high": 4.0,  # engine num_waiting per backend counted as a queue
    "gateway_queue_high": 4.0,  # gateway admission queue depth per model
    "pool_busy_kv": 0.80,  # a backend is busy with waiting > 0 or kv at or above this
}
_T = THRESHOLDS


@dataclass(frozen=True)
class EngineRead:
    """One read of an engine's ``/metrics`` (vLLM names)."""

    ok: bool = True
    error: str = ""
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    generation_tokens: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None


@dataclass(frozen=True)
class BackendFacts:
    """What the rules know about one backend (every number may be unknown: None)."""

    name: str
    model: str = ""
    url: str = ""
    # the gateway's view (/admin/backends, /metrics)
    healthy: bool = True
    routable: bool = True
    draining: bool = False
    unhealthy_reasons: tuple[str, ...] = ()
    probe_failure: str = ""  # why the gateway's active probes failed ("" once they pass)
    ejected: bool = False
    demoted: bool = False
    in_flight: int = 0
    consecutive_errors: int = 0
    ewma_ttft_ms: float | None = None
    ewma_tpot_ms: float | None = None
    scrape_stale: bool = False
    attempts: float = 0.0  # gateway attempts to it in the window
    errors: float = 0.0  # ... that answered 5xx
    # the doctor's own probes of the engine
    connect_ok: bool = True
    health_ok: bool | None = True
    health_error: str = ""
    rtt_ms: float | None = None
    metrics_ok: bool = True
    metrics_error: str = ""
    # the engine's own metrics (last read; deltas over the window)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    waiting_delta: float | None = None
    preemptions_delta: float | None = None
    tokens_delta: float | None = None
    engine_itl_ms: float | None = None
    engine_ttft_ms: float | None = None
    # the two above are means over the window's requests; False: the engine served none
    # in the window (e.g. the gateway routes around it) and they are its whole history's
    engine_in_window: bool = True


@dataclass(frozen=True)
class Snapshot:
    gateway_url: str = ""
    gateway_rtt_ms: float | None = None
    window_s: float = 1.0
    backends: tuple[BackendFacts, ...] = ()
    queue_depth: Mapping[str, float] = field(default_factory=dict)  # model -> gateway queue


@dataclass(frozen=True)
class Finding:
    cause: str
    backend: str  # a backend name, or "pool MODEL"
    score: float
    evidence: str
    advice: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause, "backend": self.backend, "score": round(self.score, 3),
            "evidence": self.evidence, "advice": self.advice,
        }  # fmt: skip


# -- reading ---------------------------------------------------------------------------


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text page: (name, labels, value); comments skipped
    (``routing.engine_metrics.parse_samples``, the gateway's own reader)."""
    return parse_samples(text)


def engine_read(text: str) -> EngineRead:
    """The numbers the rules use from an engine's vLLM-style ``/metrics`` page."""
    sums: dict[str, float] = {}
    for name, _, value in parse_prometheus(text):
        key = name.removeprefix("vllm:")
        if key == "kv_cache_usage_perc" or key == "gpu_cache_usage_perc":
            sums["kv"] = max(sums.get("kv", 0.0), value)
        else:
            sums[key] = sums.get(key, 0.0) + value
    return EngineRead(
        running=sums.get("num_requests_running"),
        waiting=sums.get("num_requests_waiting"),
        kv_usage=sums.get("kv"),
        preemptions=sums.get("num_preemptions_total"),
        generation_tokens=sums.get("generation_tokens_total"),
        ttft_sum=sums.get("time_to_first_token_seconds_sum"),
        ttft_count=sums.get("time_to_first_token_seconds_count"),
        itl_sum=sums.get("inter_token_latency_seconds_sum"),
        itl_count=sums.get("inter_token_latency_seconds_count"),
    )


def gateway_counts(text: str) -> dict[str, Any]:
    """Per-backend attempts and 5xx, ejected/demoted flags and queue depth per model."""
    attempts: dict[str, float] = {}
    errors: dict[str, float] = {}
    flags: dict[str, dict[str, bool]] = {}
    ejections: dict[str, float] = {}
    queue: dict[str, float] = {}
    missing = 0.0
    for name, labels, value in parse_prometheus(text):
        backend = labels.get("backend", "")
        if name == "kiloserve_gateway_requests_total" and backend:
            attempts[backend] = attempts.get(backend, 0.0) + value
            if labels.get("status", "").startswith("5"):
                errors[backend] = errors.get(backend, 0.0) + value
        elif name in ("kiloserve_gateway_backend_ejected", "kiloserve_gateway_backend_demoted"):
            # one series per worker (``--workers N``): set when any worker says so
            flag, key = flags.setdefault(backend, {}), name.rsplit("_", 1)[1]
            flag[key] = flag.get(key, False) or value > 0
        elif name == "kiloserve_gateway_outlier_ejections_total" and backend:
            ejections[backend] = ejections.get(backend, 0.0) + value
        elif name == "kiloserve_gateway_queue_depth":
            model = labels.get("model", "")
            queue[model] = queue.get(model, 0.0) + value
        elif name == "kiloserve_gateway_worker_pages_missing":
            missing = value
    return {
        "attempts": attempts,
        "errors": errors,
        "flags": flags,
        "ejections": ejections,
        "queue": queue,
        # ``--workers N``: siblings whose counters this merged page lacks (read it again)
        "missing_workers": missing,
    }


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _new_samples(first: EngineRead, last: EngineRead, key: str) -> float:
    """Samples a histogram counted between the two reads (0 when either is unknown)."""
    c0: float | None = getattr(first, key + "_count")
    c1: float | None = getattr(last, key + "_count")
    return c1 - c0 if c0 is not None and c1 is not None else 0.0


def _mean_ms(first: EngineRead, last: EngineRead, key: str) -> float | None:
    """Mean of a histogram in the window (ms); the whole history when the window saw none."""
    s0: float | None = getattr(first, key + "_sum")
    s1: float | None = getattr(last, key + "_sum")
    c1: float | None = getattr(last, key + "_count")
    if s1 is None or not c1:
        return None
    num_new = _new_samples(first, last, key)
    if s0 is not None and num_new > 0:
        return 1000.0 * (s1 - s0) / num_new
    return 1000.0 * s1 / c1


def facts_from_reads(
    row: Mapping[str, Any],
    *,
    first: EngineRead,
    last: EngineRead,
    gw_first: Mapping[str, Any],
    gw_last: Mapping[str, Any],
    connect_ok: bool,
    health_ok: bool | None,
    health_error: str,
    rtt_ms: float | None,
) -> BackendFacts:
    """One backend's facts from its ``/admin/backends`` row, two engine reads and two
    reads of the gateway's ``/metrics`` (``gateway_counts``) a window apart."""
    name = str(row.get("name", ""))
    flags = gw_last.get("flags", {}).get(name, {})
    flags_first = gw_first.get("flags", {}).get(name, {})
    ejections = gw_last.get("ejections", {}).get(name, 0.0) - gw_first.get("ejections", {}).get(
        name, 0.0
    )
    attempts = gw_last["attempts"].get(name, 0.0) - gw_first["attempts"].get(name, 0.0)
    errors = gw_last["errors"].get(name, 0.0) - gw_first["errors"].get(name, 0.0)
    models = row.get("models") or [""]
    both = first.ok and last.ok
    return BackendFacts(
        name=name,
        model=str(models[0]),
        url=str(row.get("url", "")),
        healthy=bool(row.get("healthy", True)),
        routable=bool(row.get("routable", True)),
        draining=bool(row.get("draining", False)),
        unhealthy_reasons=tuple(str(r) for r in row.get("unhealthy_reasons") or ()),
        probe_failure=str(row.get("probe_failure") or ""),
        # ejected at either read or during the window: an ejection that expired (and whose
        # half-open trial passed) between the two reads is still this window's evidence
        ejected=bool(flags.get("ejected") or flags_first.get("ejected") or ejections > 0),
        demoted=bool(flags.get("demoted", False)),
        in_flight=int(row.get("in_flight") or 0),
        consecutive_errors=int(row.get("consecutive_errors") or 0),
        ewma_ttft_ms=row.get("ewma_ttft_ms"),
        ewma_tpot_ms=row.get("ewma_tpot_ms"),
        scrape_stale=bool(row.get("scrape_stale", False)),
        attempts=max(0.0, attempts),
        errors=max(0.0, errors),
        connect_ok=connect_ok,
        health_ok=health_ok,
        health_error=health_error,
        rtt_ms=rtt_ms,
        metrics_ok=last.ok,
        metrics_error=last.error or first.error,
        running=last.running if last.ok else None,
        waiting=last.waiting if last.ok else None,
        kv_usage=last.kv_usage if last.ok else None,
        waiting_delta=_delta(first.waiting, last.waiting) if both else None,
        preemptions_delta=_delta(first.preemptions, last.preemptions) if both else None,
        tokens_delta=_delta(first.generation_tokens, last.generation_tokens) if both else None,
        engine_itl_ms=_mean_ms(first, last, "itl") if last.ok else None,
        engine_ttft_ms=_mean_ms(first, last, "ttft") if last.ok else None,
        engine_in_window=both
        and (_new_samples(first, last, "itl") > 0 or _new_samples(first, last, "ttft") > 0),
    )


# -- rules -----------------------------------------------------------------------------

Rule = Callable[[Snapshot], list[Finding]]


def _finding(cause: str, backend: str, score: float, evidence: Iterable[str]) -> Finding:
    return Finding(cause, backend, min(1.0, max(0.0, score)), "; ".join(evidence), CAUSES[cause])


def _pools(snap: Snapshot) -> dict[str, list[BackendFacts]]:
    pools: dict[str, list[BackendFacts]] = {}
    for b in snap.backends:
        pools.setdefault(b.model, []).append(b)
    return pools


def _peer_median(b: BackendFacts, pool: list[BackendFacts], key: str) -> float | None:
    values = [getattr(p, key) for p in pool if p is not b and getattr(p, key) is not None]
    return statistics.median(values) if values else None


def _ratio(b: BackendFacts, pool: list[BackendFacts], key: str) -> tuple[float, float] | None:
    """(value, peer median) when both are known and the median is positive."""
    value, median = getattr(b, key), _peer_median(b, pool, key)
    if value is None or median is None or median <= 0:
        return None
    return float(value), float(median)


def rule_down_or_hung(snap: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    for b in snap.backends:
        if not b.connect_ok:
            ev = [f"TCP connect to {b.url or b.name} fails"]
            if not b.healthy:
                ev.append(f"gateway marks it unhealthy ({', '.join(b.unhealthy_reasons) or '-'})")
            out.append(_finding("engine_down", b.name, 0.97, ev))
            continue
        score, ev = 0.0, []
        if b.health_ok is False:
            score = max(score, 0.9)
            ev.append(f"GET /health fails ({b.health_error or 'no answer'}) while TCP connects")
        if not b.metrics_ok:
            score = max(score, 0.7)
            ev.append(f"GET /metrics fails ({b.metrics_error or 'no answer'})")
        if b.running and b.running > 0 and b.tokens_delta == 0:
            score = max(score, 0.9)
            ev.append(f"{b.running:g} running with no token generated in {snap.window_s:g} s")
        if not b.healthy and b.unhealthy_reasons and score > 0:
            score = min(1.0, score + 0.05)
            ev.append(f"gateway marks it unhealthy ({', '.join(b.unhealthy_reasons)})")
        if score > 0:
            out.append(_finding("hung_engine", b.name, score, ev))
    return out


def rule_error_burst(snap: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    for b in snap.backends:
        share = b.errors / b.attempts if b.attempts else 0.0
        burst = b.errors >= _T["error_min"] and share >= _T["error_share"]
        streak = b.consecutive_errors >= _T["consecutive_errors"]
        # the gateway's own probe got a 5xx: held out by it, the backend may see no request
        # in the window at all, and that is still an error burst
        probe_5xx = _is_5xx_probe(b.probe_failure)
        if not (burst or b.ejected or streak or probe_5xx):
            continue
        ev, score = [], 0.0
        if b.attempts:
            ev.append(f"{b.errors:g} of {b.attempts:g} attempts answered 5xx ({share:.0%})")
        if burst:
            score = 0.6 + 0.35 * share
        if probe_5xx:
            held = "" if b.healthy else ", and holds it out"
            ev.append(f"the gateway's health probe got {b.probe_failure}{held}")
            score = max(score, 0.6 if b.healthy else 0.75)
        if streak:
            ev.append(f"{b.consecutive_errors} consecutive errors")
            # a streak is current evidence only while requests still fail (or it is ejected)
            score = max(score, 0.7 if (b.errors > 0 or b.ejected) else 0.45)
        if b.ejected:
            score = max(score, 0.6) + 0.15
            ev.append("ejected by outlier detection")
        if not b.connect_ok or b.health_ok is False:
            score = min(score, 0.5)
            ev.append("probably a symptom: the engine does not answer /health")
        out.append(_finding("error_burst", b.name, score, ev))
    return out


def _is_5xx_probe(why: str) -> bool:
    """A probe failure the backend answered with a 5xx: the prober's ``"<probe> http
    <status>"`` (``gateway/resilience/prober.py``, e.g. ``"completion http 500"``)."""
    _, sep, status = why.rpartition("http ")
    return bool(sep) and status.startswith("5") and status.isdigit()


def _engine_slow(b: BackendFacts, pool: list[BackendFacts]) -> tuple[float, list[str]]:
    """The largest ratio of the engine's own latency to its peers' median, and evidence."""
    best, ev = 0.0, []
    for key, label in (("engine_itl_ms", "engine inter-token"), ("engine_ttft_ms", "engine TTFT")):
        got = _ratio(b, pool, key)
        if got is None:
            continue
        value, median = got
        ratio = value / median
        if ratio >= _T["slow_ratio"] and value >= _T["slow_min_ms"]:
            ev.append(f"{label} {value:.1f} ms vs pool median {median:.1f} ms ({ratio:.1f}x)")
        best = max(best, ratio)
    return best, ev


def _gateway_slow(b: BackendFacts, pool: list[BackendFacts]) -> tuple[float, list[str]]:
    best, ev = 0.0, []
    for key, label in (
        ("ewma_tpot_ms", "gateway TPOT EWMA"),
        ("ewma_ttft_ms", "gateway TTFT EWMA"),
    ):
        got = _ratio(b, pool, key)
        if got is None:
            continue
        value, median = got
        ratio = value / median
        if ratio >= _T["slow_ratio"] and value >= _T["slow_min_ms"]:
            ev.append(f"{label} {value:.1f} ms vs pool median {median:.1f} ms ({ratio:.1f}x)")
        best = max(best, ratio)
    return best, ev


def _rtt_high(b: BackendFacts, pool: list[BackendFacts]) -> tuple[bool, str]:
    if b.rtt_ms is None or b.rtt_ms < _T["rtt_min_ms"]:
        return False, ""
    median = _peer_median(b, pool, "rtt_ms")
    if median is not None and b.rtt_ms < _T["rtt_ratio"] * median:
        return False, ""
    ref = f"pool median {median:.1f} ms" if median is not None else "no peer to compare"
    return True, f"round trip {b.rtt_ms:.1f} ms ({ref})"


def _engine_known(b: BackendFacts) -> bool:
    """Whether the engine reported any latency of its own (the window's or its history's)."""
    return b.engine_itl_ms is not None or b.engine_ttft_ms is not None


def _gateway_view_counts(b: BackendFacts, pool: list[BackendFacts]) -> bool:
    """Whether the gateway's EWMAs are the evidence on ``b``'s speed: the engine has no
    latency figures, or only its history's (no request reached it in the window) while
    the gateway routes around it (demoted, or its peers served requests in the window;
    on an idle pool the EWMAs are as old as the history)."""
    if not _engine_known(b):
        return True
    if b.engine_in_window:
        return False
    return b.demoted or any(_engine_known(p) and p.engine_in_window for p in pool if p is not b)


def rule_slow_or_network(snap: Snapshot) -> list[Finding]:
    """Slow node (the engine's own latency is high) versus network delay (the round trip
    is high while the engine's own latency is normal)."""
    out: list[Finding] = []
    for pool in _pools(snap).values():
        for b in pool:
            if not b.connect_ok or b.health_ok is False:
                continue  # down or hung: another rule
            engine_ratio, engine_ev = _engine_slow(b, pool)
            gw_ratio, gw_ev = _gateway_slow(b, pool)
            rtt_high, rtt_ev = _rtt_high(b, pool)
            if engine_ev:
                ev = engine_ev + gw_ev + (["demoted by the gateway"] if b.demoted else [])
                score = 0.55 + 0.1 * min(3.5, engine_ratio - _T["slow_ratio"])
                out.append(_finding("slow_node", b.name, score, ev))
            elif rtt_high:
                known = _engine_known(b)
                ev = [rtt_ev, *gw_ev]
                if known:
                    ev.append(f"engine's own latency normal ({engine_ratio:.1f}x pool median)")
                score = (0.7 if known else 0.55) + (0.15 if gw_ev else 0.0)
                out.append(_finding("network_delay", b.name, score, ev))
            elif gw_ev and _gateway_view_counts(b, pool):
                # only the gateway's view: slow, engine or path unknown (no engine figures,
                # or only its history: the gateway routed nothing to it in the window)
                ev = gw_ev + (["demoted by the gateway"] if b.demoted else [])
                if _engine_known(b):
                    ev.append("no request reached the engine in the window")
                score = 0.4 + 0.05 * min(3.0, gw_ratio - _T["slow_ratio"])
                out.append(_finding("slow_node", b.name, score, ev))
    return out


def rule_kv_saturation(snap: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    for b in snap.backends:
        kv_high = b.kv_usage is not None and b.kv_usage >= _T["kv_high"]
        kv_busy = b.kv_usage is not None and b.kv_usage >= _T["pool_busy_kv"]
        preempting = bool(b.preemptions_delta and b.preemptions_delta > 0)
        if not (kv_high or preempting):
            continue
        ev, score = [], 0.0
        if b.kv_usage is not None:
            ev.append(f"kv_cache_usage {b.kv_usage:.2f}")
            if kv_high:
                score += 0.55 + 0.5 * (b.kv_usage - _T["kv_high"])
            elif kv_busy:
                score += 0.4
        if preempting:
            score += 0.3
            ev.append(f"{b.preemptions_delta:g} preemptions in {snap.window_s:g} s")
        if b.waiting:
            growing = b.waiting_delta is not None and b.waiting_delta > 0
            score += 0.1 if growing else 0.05
            ev.append(f"{b.waiting:g} waiting" + (f" (+{b.waiting_delta:g})" if growing else ""))
        out.append(_finding("kv_saturation", b.name, score, ev))
    return out


def _busy(b: BackendFacts) -> bool:
    return (b.waiting or 0.0) >= _T["waiting_high"] or (
        b.kv_usage is not None and b.kv_usage >= _T["pool_busy_kv"]
    )


def _idle(b: BackendFacts) -> bool:
    return not b.waiting and not b.running and b.in_flight == 0


def rule_queue_and_pools(snap: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    pools = _pools(snap)
    idle_pools = [
        m for m, pool in pools.items()
        if all(_idle(b) for b in pool if b.routable) and any(b.routable for b in pool)
    ]  # fmt: skip
    for model, pool in pools.items():
        live = [b for b in pool if b.routable and b.connect_ok and b.waiting is not None]
        ev: list[str] = []
        queued = snap.queue_depth.get(model, 0.0)
        if queued >= _T["gateway_queue_high"]:
            ev.append(f"{queued:g} requests queued at the gateway for {model}")
        waiting = [b.waiting or 0.0 for b in live]
        if live and min(waiting) >= _T["waiting_high"]:
            ev.append(f"every backend of {model} has >= {min(waiting):g} waiting (median "
                      f"{statistics.median(waiting):g})")  # fmt: skip
        if ev:
            score = 0.5 + 0.05 * min(6.0, len(ev) + statistics.median(waiting or [0.0]) / 8)
            out.append(_finding("queue_buildup", f"pool {model}", score, ev))
        others = [m for m in idle_pools if m != model]
        if live and all(_busy(b) for b in live) and others:
            ev2 = [f"all {len(live)} backends of {model} busy (waiting >= "
                   f"{_T['waiting_high']:g} or KV >= {_T['pool_busy_kv']:g})",
                   f"idle pools: {', '.join(others)}"]  # fmt: skip
            out.append(_finding("pool_short", f"pool {model}", 0.6, ev2))
    return out


RULES: tuple[Rule, ...] = (
    rule_down_or_hung,
    rule_error_burst,
    rule_slow_or_network,
    rule_kv_saturation,
    rule_queue_and_pools,
)


def diagnose(snap: Snapshot) -> list[Finding]:
    """Every rule's findings, most probable (highest score) first."""
    found = [f for rule in RULES for f in rule(snap)]
    return sorted(found, key=lambda f: (-f.score, f.cause, f.backend))
