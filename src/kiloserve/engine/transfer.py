"""KV transfer time between engines (disaggregated prefill/decode) and to host memory.

A decode engine pulls the KV of a prompt from the prefill engine that computed it
(vLLM's NixlConnector: one-sided RDMA reads of the prefill engine's blocks). The
model is one link crossed at its nominal per-direction bandwidth plus a fixed
latency::

    kv_transfer_time_s = num_tokens x kv_bytes_per_token / bandwidth + latency

``kv_bytes_per_token`` is one GPU's share (``MemoryLedger.kv_bytes_per_token_per_gpu``,
i.e. ``EngineConfig.kv_bytes_per_token``): the ranks of a TP group move their own
shards in parallel, each over its own link, so the per-GPU bytes over the per-GPU
link is the group's time. Links (``link_for``), per GPU, from the catalog:

* ``nvlink``: ``link_bandwidth_gbs`` (prefill and decode on one NVLink domain);
* ``network``: ``network_bandwidth_gbs`` (the GPU's NIC: 400 Gb/s = 50 GB/s);
* ``pcie``: ``pcie_bandwidth_gbs`` (through host memory, e.g. a CPU tier).

The latency stands for one transfer's fixed cost (the read's round trip and its
completion notice). Not modelled: contention with other transfers or with TP
traffic, a prefill and decode TP mismatch, and per-layer pipelining (the transfer
starts when the prefill ends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from kiloserve.catalog import GpuSpec
from kiloserve.errors import ConfigError

__all__ = ["LINK_KINDS", "LINK_LATENCY_S", "KvLink", "kv_transfer_time_s", "link_for"]

LINK_KINDS: Final = ("nvlink", "network", "pcie")
# One transfer's fixed cost per link kind, in seconds (an assumption, see the docstring).
LINK_LATENCY_S: Final = {"nvlink": 10e-6, "network": 100e-6, "pcie": 20e-6}


@dataclass(frozen=True, slots=True)
class KvLink:
    """One link KV crosses: its name, per-direction bandwidth and fixed latency."""

    name: str
    bandwidth_bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise ConfigError(f"link {self.name}: bandwidth_bps must be > 0")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ConfigError(f"link {self.name}: latency_s must be >= 0")


def link_for(gpu: GpuSpec, kind: str) -> KvLink:
    """The ``kind`` link (``nvlink``, ``network`` or ``pcie``) of one ``gpu``."""
    if kind == "nvlink":
        gbs = gpu.link_bandwidth_gbs
    elif kind == "network":
        gbs = gpu.network_bandwidth_gbs
    elif kind == "pcie":
        gbs = gpu.pcie_bandwidth_gbs
    else:
        raise ConfigError(f"kv link must be one of {', '.join(LINK_KINDS)}, got {kind!r}")
    return KvLink(kind, gbs * 1e9, LINK_LATENCY_S[kind])


def kv_transfer_time_s(num_tokens: int, kv_bytes_per_token: int, link: KvLink) -> float:
    """Seconds to move ``num_tokens`` tokens of KV over ``link`` (0 tokens: 0 s)."""
    if num_tokens < 0 or kv_bytes_per_token < 0:
        raise ConfigError(
            f"num_tokens and kv_bytes_per_token must be >= 0, got {num_tokens}, "
            f"{kv_bytes_per_token}"
        )
    if num_tokens == 0:
        return 0.0
    return num_tokens * kv_bytes_per_token / link.bandwidth_bps + link.latency_s
