"""Engine metric parsing: a ``/metrics`` page -> ``EngineMetrics`` (no I/O).

``parse_engine_metrics`` is a fast line parser over Prometheus text: it looks only at
the metric names it needs (vLLM new and legacy names, SGLang, llama.cpp, TGI and a
DCGM PCIe pair) and ignores everything else. Several series of one name (e.g. one per
``engine`` / ``model_name`` label) are summed for counts and maxed for usage fractions.

Names understood (``field <- names``):

* num_running  <- vllm:num_requests_running, sglang:num_running_reqs,
  llamacpp:requests_processing, tgi_batch_current_size
* num_waiting  <- vllm:num_requests_waiting, sglang:num_queue_reqs,
  llamacpp:requests_deferred, tgi_queue_size
* kv_usage (0..1) <- vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc (legacy),
  sglang:token_usage, llamacpp:kv_cache_usage_ratio
* prefix_hit_rate <- vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total
  (legacy vllm:gpu_prefix_cache_*), vllm:gpu_prefix_cache_hit_rate, sglang:cache_hit_rate
* prefix_queries_tokens, prefix_hits_tokens <- the raw cumulative counters
  vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (legacy
  vllm:gpu_prefix_cache_*), in tokens; None when the engine has no such counters (SGLang)
* num_preemptions <- vllm:num_preemptions_total (legacy vllm:num_preemptions)
* pcie_util <- max(DCGM_FI_PROF_PCIE_TX_BYTES, DCGM_FI_PROF_PCIE_RX_BYTES) / 32 GB/s
  (PCIe Gen4 x16, per direction), clipped to [0, 1]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Final

from kiloserve.values import Value

__all__ = ["PCIE_PEAK_BYTES_S", "EngineMetrics", "parse_engine_metrics", "parse_samples"]

PCIE_PEAK_BYTES_S = 32e9

_SUM = "sum"
_MAX = "max"
# metric name -> (field, how several series combine)
_NAMES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("num_running", _SUM),
    "sglang:num_running_reqs": ("num_running", _SUM),
    "llamacpp:requests_processing": ("num_running", _SUM),
    "tgi_batch_current_size": ("num_running", _SUM),
    "vllm:num_requests_waiting": ("num_waiting", _SUM),
    "sglang:num_queue_reqs": ("num_waiting", _SUM),
    "llamacpp:requests_deferred": ("num_waiting", _SUM),
    "tgi_queue_size": ("num_waiting", _SUM),
    "vllm:kv_cache_usage_perc": ("kv_usage", _MAX),
    "vllm:gpu_cache_usage_perc": ("kv_usage", _MAX),
    "sglang:token_usage": ("kv_usage", _MAX),
    "llamacpp:kv_cache_usage_ratio": ("kv_usage", _MAX),
    "vllm:prefix_cache_queries_total": ("prefix_queries", _SUM),
    "vllm:gpu_prefix_cache_queries_total": ("prefix_queries", _SUM),
    "vllm:prefix_cache_hits_total": ("prefix_hits", _SUM),
    "vllm:gpu_prefix_cache_hits_total": ("prefix_hits", _SUM),
    "vllm:gpu_prefix_cache_hit_rate": ("prefix_hit_rate", _MAX),
    "sglang:cache_hit_rate": ("prefix_hit_rate", _MAX),
    "vllm:num_preemptions_total": ("num_preemptions", _SUM),
    "vllm:num_preemptions": ("num_preemptions", _SUM),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("pcie_bytes_s", _MAX),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("pcie_bytes_s", _MAX),
}
_ENGINE_PREFIXES = (("vllm:", "vllm"), ("sglang:", "sglang"), ("llamacpp:", "llamacpp"))


class EngineMetrics(Value):
    """The engine signals the gateway uses; ``None`` means the engine did not say.

    A ``Value`` (read-only, equality by fields), not a dataclass: the simulator builds
    one per changed backend per scrape round, and its compiled build would run a
    dataclass's ``__init__`` as interpreted code (``kiloserve.values``)."""

    _FIELDS: ClassVar[tuple[str, ...]] = (
        "engine",
        "num_running",
        "num_waiting",
        "kv_usage",
        "prefix_hit_rate",
        "num_preemptions",
        "pcie_util",
        "prefix_queries_tokens",
        "prefix_hits_tokens",
    )
    __slots__ = _FIELDS
    #: the numeric fields (all but ``engine``), in order (``routing.shared_load`` packs them)
    NUMBERS: ClassVar[tuple[str, ...]] = _FIELDS[1:]

    def __init__(
        self,
        engine: str | None = None,
        num_running: int | None = None,
        num_waiting: int | None = None,
        kv_usage: float | None = None,
        prefix_hit_rate: float | None = None,
        num_preemptions: int | None = None,
        pcie_util: float | None = None,
        prefix_queries_tokens: float | None = None,  # cumulative counter (resets on restart)
        prefix_hits_tokens: float | None = None,
    ) -> None:
        self.engine: Final = engine
        self.num_running: Final = num_running
        self.num_waiting: Final = num_waiting
        self.kv_usage: Final = kv_usage
        self.prefix_hit_rate: Final = prefix_hit_rate
        self.num_preemptions: Final = num_preemptions
        self.pcie_util: Final = pcie_util
        self.prefix_queries_tokens: Final = prefix_queries_tokens
        self.prefix_hits_tokens: Final = prefix_hits_tokens


def _split_sample(line: str) -> tuple[str, float] | None:
    """``name{labels} value [ts]`` -> (name, value); None for lines we cannot read."""
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace]
        rest = line[line.rfind("}") + 1 :].split()
    else:
        parts = line.split()
        if len(parts) < 2:
            return None
        name, rest = parts[0], parts[1:]
    if not rest:
        return None
    try:
        return name, float(rest[0])
    except ValueError:
        return None


def _samples(text: str, *, strip: bool = False) -> Iterator[tuple[str, str, float]]:
    """(line, name, value) of every readable sample line (comments and blanks skipped);
    ``strip``: lines may carry surrounding whitespace."""
    for raw in text.splitlines():
        line = raw.strip() if strip else raw
        if not line or line[0] == "#":
            continue
        sample = _split_sample(line)
        if sample is not None:
            yield line, sample[0], sample[1]


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page as (name, labels, value), tolerantly: a
    line that cannot be read (or a comment) is skipped, a timestamp ignored. Label
    values are unquoted, not unescaped (enough for the names and ids we match on)."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line, name, value in _samples(text, strip=True):
        labels: dict[str, str] = {}
        brace = line.find("{")
        if brace >= 0:
            for part in line[brace + 1 : line.rfind("}")].split('",'):
                key, eq, val = part.partition("=")
                if eq:
                    labels[key.strip()] = val.strip().strip('"')
        out.append((name.strip(), labels, value))
    return out


def _engine_of(name: str) -> str | None:
    for prefix, engine in _ENGINE_PREFIXES:
        if name.startswith(prefix):
            return engine
    return "tgi" if name.startswith("tgi_") else None


def _collect(text: str) -> tuple[dict[str, float], str | None]:
    values: dict[str, float] = {}
    engine: str | None = None
    for _, name, value in _samples(text):
        spec = _NAMES.get(name)
        if spec is None or value != value:  # unknown name or NaN
            continue
        field, how = spec
        engine = engine or _engine_of(name)
        old = values.get(field)
        if old is None:
            values[field] = value
        else:
            values[field] = old + value if how == _SUM else max(old, value)
    return values, engine


def _hit_rate(values: dict[str, float]) -> float | None:
    queries = values.get("prefix_queries")
    hits = values.get("prefix_hits")
    if queries is not None and hits is not None and queries > 0:
        return min(1.0, hits / queries)
    return values.get("prefix_hit_rate")


def _as_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse a ``/metrics`` page of vLLM, SGLang, llama.cpp or TGI."""
    values, engine = _collect(text)
    kv = values.get("kv_usage")
    pcie = values.get("pcie_bytes_s")
    return EngineMetrics(
        engine=engine,
        num_running=_as_int(values.get("num_running")),
        num_waiting=_as_int(values.get("num_waiting")),
        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
        prefix_hit_rate=_hit_rate(values),
        num_preemptions=_as_int(values.get("num_preemptions")),
        pcie_util=None if pcie is None else min(1.0, max(0.0, pcie / PCIE_PEAK_BYTES_S)),
        prefix_queries_tokens=values.get("prefix_queries"),
        prefix_hits_tokens=values.get("prefix_hits"),
    )
