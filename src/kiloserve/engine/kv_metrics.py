"""The twin's P/D transfer and KV-tier metrics, under vLLM's names where vLLM has them.

Transfers (decode side), as vLLM's NixlConnector exports them (same buckets):
``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred`` (histograms, one
observation per decode leg: the modelled pull of the prompt's KV, bytes over all TP
ranks), ``vllm:nixl_num_failed_transfers`` (a decode leg whose prefill KV was gone:
it recomputed the prompt), ``vllm:nixl_num_failed_notifications`` (a release the
prefill engine did not confirm: vLLM's D side notifies P the same way) and, prefill side,
``vllm:nixl_num_kv_expired_reqs`` (held KV freed by ``--kv-hold-timeout-s``).

Read at scrape time: ``kiloserve:kv_held_blocks`` / ``kiloserve:kv_held_requests``
(prefill legs' KV waiting for their decode engine; vLLM has no such gauge) and
``kiloserve:engine_role_info{role}`` (value 1).

KV tiers (only with ``--kv-cpu-gib`` / ``--kv-remote-gib``), read at scrape time from
the engine core's tier counters. As vLLM counts its offloading connector's hits:
``vllm:external_prefix_cache_queries`` / ``_hits`` (every token of each sequence
admitted with a tier lookup, tokens found in a tier), ``vllm:kv_offload_total_bytes{transfer_type=
"GPU_to_CPU"|"CPU_to_GPU"}`` and ``vllm:kv_offload_cpu_cache_usage_perc``. vLLM has
no remote tier of its own (LMCache's are its own metrics), so per tier:
``kiloserve:kv_tier_hit_tokens{tier}``, ``kiloserve:kv_tier_offloaded_blocks{tier}``,
``kiloserve:kv_tier_usage_perc{tier}``, plus ``kiloserve:kv_tier_loaded_bytes`` and
``kiloserve:kv_tier_load_seconds`` (step time spent loading). Bytes are over all TP
ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["NIXL_BYTES_BUCKETS", "NIXL_XFER_TIME_BUCKETS_S", "KvMetrics"]

_LABELS = ("model_name", "engine")
# vLLM's NixlPromMetrics buckets
NIXL_XFER_TIME_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB


class HeldSource(Protocol):
    """What the scrape reads of the engine core (held blocks) and the hold registry."""

    @property
    def num_held_blocks(self) -> int: ...


class HoldsSource(Protocol):
    @property
    def num_held_requests(self) -> int: ...


class _KvCollector(Collector):
    """Held prefill KV and the role, read at scrape time."""

    def __init__(self, core: HeldSource, holds: HoldsSource, role: str, labels: list[str]) -> None:
        self._core = core
        self._holds = holds
        self._role = role
        self._labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(_LABELS))
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        yield self._gauge(
            "kiloserve:kv_held_blocks",
            "KV blocks of finished prefill legs waiting for their decode engine.",
            self._core.num_held_blocks,
        )
        yield self._gauge(
            "kiloserve:kv_held_requests",
            "Finished prefill legs whose KV waits for their decode engine.",
            self._holds.num_held_requests,
        )
        role = GaugeMetricFamily(
            "kiloserve:engine_role_info",
            "The engine's role in disaggregated serving (value 1).",
            labels=[*_LABELS, "role"],
        )
        role.add_metric([*self._labels, self._role], 1)
        yield role


class TierConfig(Protocol):
    @property
    def block_size(self) -> int: ...
    @property
    def kv_bytes_per_block(self) -> int: ...
    @property
    def kv_cpu_blocks(self) -> int: ...
    @property
    def kv_remote_blocks(self) -> int: ...


class TierSource(Protocol):
    """What the scrape reads of ``EngineCore``'s tier counters."""

    @property
    def config(self) -> TierConfig: ...
    @property
    def kv_tier_queries_tokens(self) -> int: ...
    @property
    def kv_cpu_hit_tokens(self) -> int: ...
    @property
    def kv_remote_hit_tokens(self) -> int: ...
    @property
    def kv_cpu_offloaded_blocks(self) -> int: ...
    @property
    def kv_remote_offloaded_blocks(self) -> int: ...
    @property
    def kv_loaded_bytes(self) -> int: ...
    @property
    def kv_load_s_total(self) -> float: ...
    @property
    def kv_cpu_blocks_used(self) -> int: ...
    @property
    def kv_remote_blocks_used(self) -> int: ...


_Kind = type[CounterMetricFamily] | type[GaugeMetricFamily]


class _TierCollector(Collector):
    """The KV tiers' counters, read at scrape time."""

    def __init__(self, core: TierSource, tp: int, labels: list[str]) -> None:
        self._core = core
        self._tp = tp
        self._labels = labels

    def _family(self, kind: _Kind, name: str, doc: str, by: dict[str, dict[str, float]]) -> Metric:
        """One family: ``by`` maps a label name to its series (``{"": {"": v}}``: none)."""
        [(label, series)] = by.items()
        family = kind(name, doc, labels=[*_LABELS, label] if label else list(_LABELS))
        for key, value in series.items():
            family.add_metric([*self._labels, key] if label else self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        core, config = self._core, self._core.config
        cpu_hits, remote_hits = core.kv_cpu_hit_tokens, core.kv_remote_hit_tokens
        bytes_per_block = config.kv_bytes_per_block * self._tp  # every rank's shard
        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        offloaded: dict[str, float] = {
            "cpu": core.kv_cpu_offloaded_blocks,
            "remote": core.kv_remote_offloaded_blocks,
        }
        moved: dict[str, float] = {
            "GPU_to_CPU": core.kv_cpu_offloaded_blocks * bytes_per_block,
            "CPU_to_GPU": cpu_hits // config.block_size * bytes_per_block,
        }
        usage = {
            tier: used / capacity
            for tier, used, capacity in (
                ("cpu", core.kv_cpu_blocks_used, config.kv_cpu_blocks),
                ("remote", core.kv_remote_blocks_used, config.kv_remote_blocks),
            )
            if capacity
        }
        families: list[tuple[_Kind, str, str, dict[str, dict[str, float]]]] = [
            (counter, "vllm:external_prefix_cache_queries",
             "External prefix cache queries (KV tiers), in tokens.",
             {"": {"": core.kv_tier_queries_tokens}}),
            (counter, "vllm:external_prefix_cache_hits",
             "External prefix cache hits (KV tiers), in tokens.",
             {"": {"": cpu_hits + remote_hits}}),
            (counter, "vllm:kv_offload_total_bytes", "KV bytes moved to and from the CPU tier.",
             {"transfer_type": moved}),
            (counter, "kiloserve:kv_tier_hit_tokens", "Prompt tokens loaded back from a KV tier.",
             {"tier": {"cpu": cpu_hits, "remote": remote_hits}}),
            (counter, "kiloserve:kv_tier_offloaded_blocks", "Blocks offloaded into a KV tier.",
             {"tier": offloaded}),
            (gauge, "kiloserve:kv_tier_usage_perc", "KV tier usage (1 = 100%).", {"tier": usage}),
            (counter, "kiloserve:kv_tier_loaded_bytes", "KV bytes loaded back from the tiers.",
             {"": {"": core.kv_loaded_bytes * self._tp}}),
            (counter, "kiloserve:kv_tier_load_seconds", "Step time spent loading from the tiers.",
             {"": {"": core.kv_load_s_total}}),
        ]  # fmt: skip
        if config.kv_cpu_blocks:
            cpu_usage = {"": {"": usage["cpu"]}}
            doc = "CPU KV tier usage (1 = 100%)."
            families.append((gauge, "vllm:kv_offload_cpu_cache_usage_perc", doc, cpu_usage))
        for kind, name, doc, by in families:
            yield self._family(kind, name, doc, by)


class KvMetrics:
    """P/D transfer metrics of one twin, in its registry."""

    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        self._registry = registry
        self._labels = labels
        self._xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            _LABELS,
            buckets=NIXL_XFER_TIME_BUCKETS_S,
            registry=registry,
        ).labels(*labels)
        self._bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            _LABELS,
            buckets=NIXL_BYTES_BUCKETS,
            registry=registry,
        ).labels(*labels)
        self._failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers.",
            _LABELS,
            registry=registry,
        ).labels(*labels)
        self._failed_notifications = Counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications.",
            _LABELS,
            registry=registry,
        ).labels(*labels)
        self._expired = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire.",
            _LABELS,
            registry=registry,
        ).labels(*labels)

    def add_collector(self, core: HeldSource, holds: HoldsSource, role: str) -> None:
        """Export the held KV and the role at scrape time."""
        self._registry.register(_KvCollector(core, holds, role, self._labels))

    def add_tier_collector(self, core: TierSource, tp: int) -> None:
        """Export the KV tiers' counters at scrape time (only call with tiers on)."""
        self._registry.register(_TierCollector(core, tp, self._labels))

    def on_transfer(self, transfer_s: float, num_bytes: int) -> None:
        """A decode leg pulled ``num_bytes`` of KV in ``transfer_s`` (modelled)."""
        self._xfer_time.observe(transfer_s)
        self._bytes.observe(num_bytes)

    def on_transfer_failed(self) -> None:
        """A decode leg found its prefill's KV gone (expired, released, or the prefill
        engine unreachable or restarted): it recomputes the prompt."""
        self._failed_transfers.inc()

    def on_release_failed(self) -> None:
        """The prefill engine did not confirm a release."""
        self._failed_notifications.inc()

    def on_expired(self) -> None:
        """A held prefill's KV was freed by the hold timeout."""
        self._expired.inc()
