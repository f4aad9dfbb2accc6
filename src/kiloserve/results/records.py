"""Plain results of a benchmark run: one ``RequestRecord`` per request, a ``BenchResult``.

Times are ``time.perf_counter`` differences in seconds; ``start_s`` is relative to the
start of the run. These objects are what ``summarize`` reads and what
``requests.jsonl`` stores (one ``RequestRecord.to_dict()`` per line).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["BenchResult", "ClientStats", "RequestRecord"]


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. ``is_ok`` means HTTP 200 and a complete stream."""

    request_id: str
    scheduled_s: float | None
    start_s: float
    input_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    is_ok: bool = False
    is_timeout: bool = False
    status: int | None = None
    error: str | None = None
    backend: str | None = None
    num_chunks: int = 0
    session_id: str | None = None
    user: str | None = None
    prefix_group: str | None = None
    queue_s: float | None = None  # engine queue time (arrival -> first scheduled); sim only

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)``; None unless ok with > 1 output token."""
        if not self.is_ok or self.output_tokens <= 1 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RequestRecord:
        return cls(**data)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ClientStats:
    """How busy the client itself was: event-loop lag and CPU use of the process."""

    lag_mean_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    cpu_util: float
    max_in_flight: int

    @property
    def is_distorted(self) -> bool:
        """True when client saturation may have inflated the measured latencies."""
        return self.lag_p99_ms > LAG_WARN_P99_MS or self.cpu_util > CPU_WARN_UTIL

    def warning(self) -> str | None:
        if not self.is_distorted:
            return None
        return (
            f"client may be saturated (event-loop lag p99 {self.lag_p99_ms:.1f} ms, "
            f"max {self.lag_max_ms:.1f} ms, CPU {self.cpu_util:.0%}): latencies may be "
            "inflated by the benchmark client itself"
        )


LAG_WARN_P99_MS = 20.0
CPU_WARN_UTIL = 0.9


@dataclass(slots=True)
class BenchResult:
    """Everything a run produced, before summarising."""

    records: list[RequestRecord]
    duration_s: float
    started_at_unix: float
    client: ClientStats
    config: dict[str, object]
    workload: dict[str, object]
    workload_digest: str
    # the run's prefix-cache counters (``kiloserve.bench.prefix_cache``); None unknown
    prefix_cache: dict[str, object] | None = None
