"""Turn a drill's request records and fault timeline into the report (pure).

Per scenario (the keys are the Interface of issue 6)::

    sent, succeeded, failed, failed_not_started, streams_cut, retried,
    detect_s, recover_s, ttft_p95_ms: {before, during, after}, user_visible_failures

plus ``failed_reasons`` (reason -> count), ``cut_without_error_event`` and the
timeline. A failed request counts in ``failed_not_started`` when it had received no
byte when the last fault before its end hit (so it should have been retried), and in
``streams_cut`` otherwise. ``user_visible_failures`` counts every request the user saw
fail or cut, started or not (the target of issue 15 is 0 in every scenario). Requests
still running when the load stopped are left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiloserve.chaos.load import RequestResult

__all__ = ["Timeline", "build_report", "p95"]


@dataclass(slots=True)
class Timeline:
    """Monotonic seconds of the drill's phases and of every fault hit (each kill...)."""

    start_s: float
    fault_s: float = 0.0
    clear_s: float = 0.0
    end_s: float = 0.0
    hits_s: list[float] = field(default_factory=list)
    detect_s: float | None = None
    recover_s: float | None = None


def p95(values: Sequence[float]) -> float | None:
    return round(float(np.percentile(values, 95)), 1) if values else None


def _last_hit(hits_s: Sequence[float], end_s: float) -> float | None:
    before = [h for h in hits_s if h <= end_s]
    return max(before) if before else None


def _is_not_started(r: RequestResult, hits_s: Sequence[float]) -> bool:
    hit = _last_hit(hits_s, r.end_s)
    return r.first_byte_s is None or hit is None or r.first_byte_s > hit


def _ttft_by_phase(done: Sequence[RequestResult], t: Timeline) -> dict[str, float | None]:
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for r in done:
        if not r.is_ok or r.ttft_ms is None:
            continue
        phase = (
            "before" if r.start_s < t.fault_s else "during" if r.start_s < t.clear_s else "after"
        )
        phases[phase].append(r.ttft_ms)
    return {k: p95(v) for k, v in phases.items()}


def build_report(results: Sequence[RequestResult], t: Timeline, retried: int) -> dict[str, Any]:
    done = [r for r in results if r.end_s > 0.0]
    failed = [r for r in done if not r.is_ok]
    not_started = [r for r in failed if _is_not_started(r, t.hits_s)]
    cut = [r for r in failed if not _is_not_started(r, t.hits_s)]
    rel = round
    return {
        "sent": len(done),
        "succeeded": len(done) - len(failed),
        "failed": len(failed),
        "failed_not_started": len(not_started),
        "streams_cut": len(cut),
        "user_visible_failures": len(failed),
        "cut_without_error_event": sum(1 for r in cut if not r.saw_error_event),
        "failed_reasons": dict(Counter(r.reason for r in failed)),
        "retried": retried,
        "detect_s": None if t.detect_s is None else rel(t.detect_s, 3),
        "recover_s": None if t.recover_s is None else rel(t.recover_s, 3),
        "ttft_p95_ms": _ttft_by_phase(done, t),
        "timeline_s": {
            "fault": rel(t.fault_s - t.start_s, 3),
            "clear": rel(t.clear_s - t.start_s, 3),
            "end": rel(t.end_s - t.start_s, 3),
            "hits": [rel(h - t.start_s, 3) for h in t.hits_s],
        },
    }
