"""``GET /metrics`` of ``kiloserve gateway --workers N``: every worker's figures, merged.

A scrape of the shared port reaches one worker (the kernel picks), so each worker
answers ``/metrics`` for the whole gateway: it reads its siblings' own pages over
loopback (each worker also listens on a private ``127.0.0.1`` port, published in the
shared segment, where ``/metrics?local=1`` is that worker's page alone) and merges
them with its own:

* counters, histograms and summaries are summed per label set (so ``rate()`` and
  ``histogram_quantile()`` see the gateway), with the ``_created`` samples dropped;
* the backend gauges read from the shared view (``ONE_VIEW``: in-flight requests,
  health, drains, weights, scrape age and the engines' prefix-cache counters, which
  every worker holds for the whole gateway) appear once, as the answering worker
  sees them, with no ``worker`` label: summed over workers they would count the
  gateway's in-flight requests N times (an autoscaler on their sum, say);
* other gauges (and untyped samples) keep one series per worker with a ``worker``
  label (queue depth, process memory, the registry watch each worker keeps:
  aggregate them as fits, e.g. ``sum by (model)`` or ``min``).

A sibling that does not answer within ``timeout_s`` is left out of that scrape (and the
page says so: ``kiloserve_gateway_worker_pages_missing`` counts this page's missing
siblings, ``kiloserve_gateway_worker_scrape_errors_total`` all of the worker's misses);
a reader that compares two pages' counters (``kiloserve doctor``) reads again when
either page misses one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ONE_VIEW", "WorkerMetrics", "merge_pages"]

_SUMMED = {"counter", "histogram", "summary", "gaugehistogram"}
_P = "kiloserve_gateway_"
# gauges every worker reads from the shared view (gateway/metrics.py, _TableCollector)
ONE_VIEW = frozenset(
    _P + name
    for name in (
        "in_flight", "backend_healthy", "backend_draining", "backend_effective_weight",
        "scrape_stale", "scrape_age_seconds", "backend_prefix_cache_queries_tokens",
        "backend_prefix_cache_hits_tokens",
    )
)  # fmt: skip


@dataclass
class _Family:
    name: str
    kind: str
    doc: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_pages(pages: Sequence[tuple[int, str]]) -> str:
    """One exposition page from ``(worker index, page text)`` pairs, the answering
    worker's first (see module doc)."""
    families: dict[str, _Family] = {}
    for i, (worker, text) in enumerate(pages):
        for fam in text_string_to_metric_families(text):
            if fam.type == "unknown" and fam.name.endswith("_created"):
                continue
            if fam.name in ONE_VIEW and fam.type == "gauge":
                if i == 0:  # the answering worker's view, as it is
                    view = families[fam.name] = _Family(fam.name, fam.type, fam.documentation)
                    for s in fam.samples:
                        view.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
                continue
            got = families.get(fam.name)
            if got is None:
                got = families[fam.name] = _Family(fam.name, fam.type, fam.documentation)
            summed = fam.type in _SUMMED
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                tagged = dict(s.labels)
                if not summed:
                    tagged["worker"] = str(worker)
                key = (s.name, tuple(sorted(tagged.items())))
                got.samples[key] = got.samples.get(key, 0.0) + s.value if summed else s.value
    out: list[str] = []
    for merged in families.values():
        kind = merged.kind if merged.kind != "unknown" else "untyped"
        out.append(f"# HELP {merged.name} {merged.doc}")
        out.append(f"# TYPE {merged.name} {kind}")
        for (name, pairs), value in merged.samples.items():
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
            out.append(f"{name}{{{body}}} {_value(value)}" if body else f"{name} {_value(value)}")
    return "\n".join(out) + "\n"


def _value(v: float) -> str:
    """Prometheus's text format for a sample value."""
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) or abs(v) >= 1e15 else f"{int(v)}.0"


class WorkerMetrics:
    """The merged page of one worker: ``render(own_page)`` fetches the siblings'."""

    def __init__(
        self,
        worker: int,
        sibling_ports: Callable[[], list[tuple[int, int]]],
        token: str | None = None,
        timeout_s: float = 1.0,
        workers: int = 0,
    ) -> None:
        self.worker = worker
        self.workers = workers  # how many the supervisor starts (0: only those published)
        self._ports = sibling_ports
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.num_errors = 0

    async def _one(self, session: aiohttp.ClientSession, port: int) -> str | None:
        url = f"http://127.0.0.1:{port}/metrics?local=1"
        try:
            async with session.get(url, headers=self._headers) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def _json(self, session: aiohttp.ClientSession, port: int, path: str) -> Any:
        url = f"http://127.0.0.1:{port}{path}?local=1"
        try:
            async with session.get(url, headers=self._headers) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None

    def _siblings(self) -> list[tuple[int, int]]:
        """``(worker, private port)`` of every other worker that published one."""
        return [(w, p) for w, p in self._ports() if w != self.worker and p > 0]

    async def sibling_json(self, path: str) -> list[Any]:
        """Every sibling's own JSON answer at ``path`` (``?local=1``); those that do not
        answer within ``timeout_s`` are left out (and counted in ``num_errors``)."""
        siblings = [p for _, p in self._siblings()]
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            docs = await asyncio.gather(*(self._json(session, p, path) for p in siblings))
        self.num_errors += sum(1 for d in docs if d is None)
        return [d for d in docs if d is not None]

    async def not_ready(self, timeout_s: float = 0.5) -> list[int]:
        """The siblings not ready: those that have not started listening yet (of
        ``workers``: they will take requests soon, with whatever backends they have
        then) and those that do not answer ``GET /ready?local=1`` with 200 within
        ``timeout_s``. A sibling that refuses the connection has stopped listening, on
        the shared port too (a dead worker that the supervisor replaces), so it gets no
        requests and is left out."""
        siblings = self._siblings()
        published = {w for w, _ in siblings}
        unstarted = [w for w in range(self.workers) if w != self.worker and w not in published]

        async def ready(session: aiohttp.ClientSession, port: int) -> bool | None:
            try:
                async with session.get(f"http://127.0.0.1:{port}/ready?local=1") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectorError:
                return None  # not listening
            except (aiohttp.ClientError, TimeoutError, OSError):
                return False

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            got = await asyncio.gather(*(ready(session, p) for _, p in siblings))
        late = [w for (w, _), ok in zip(siblings, got, strict=True) if ok is False]
        return sorted(unstarted + late)

    async def render(self, own: str) -> str:
        siblings = self._siblings()
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            texts = await asyncio.gather(*(self._one(session, p) for _, p in siblings))
        pages = [(self.worker, own)]
        pages += [(w, t) for (w, _), t in zip(siblings, texts, strict=True) if t is not None]
        missing = texts.count(None)
        self.num_errors += missing
        errors = (
            "# HELP kiloserve_gateway_worker_scrape_errors sibling workers whose page was "
            "missing from a merged /metrics\n# TYPE kiloserve_gateway_worker_scrape_errors "
            f"counter\nkiloserve_gateway_worker_scrape_errors_total {self.num_errors}\n"
            "# HELP kiloserve_gateway_worker_pages_missing sibling workers missing from this "
            "page (its counters are short by theirs)\n"
            "# TYPE kiloserve_gateway_worker_pages_missing gauge\n"
            f"kiloserve_gateway_worker_pages_missing {missing}\n"
        )
        return merge_pages(pages) + errors
