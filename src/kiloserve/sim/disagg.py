"""Disaggregated prefill/decode (P/D) in the simulator: the KV transfer and its counters.

A cluster with ``role: prefill`` / ``role: decode`` lines runs split requests as the
live gateway and twins do (``gateway/disagg.py``, the twin's ``kv_transfer_params``),
with the gateway's own rule (``routing/disagg.py``: ``should_split``, the policy
restricted to prefill backends, ``rank_decode``). Flow of one split request
(d = network delay, o = a backend's API overhead, T = the KV transfer)::

    Arrival(t)                 gateway: should_split -> prefill leg to the policy's
                               choice among prefill backends (max_tokens 1, blocks held)
    EngineAdd(t + d + o_p)     prefill backend: the prompt is computed, one token
    RequestDone(+d)            gateway: the prefill answer; the decode leg goes to the
                               first of rank_decode's order (taken now, as the gateway)
    EngineAdd(+d + o_d + T)    decode backend: pulls the KV (T), then adds the sequence
                               with num_transferred_tokens = prompt - 1
    KvRelease(+d)              prefill backend: the decode twin's release frees the blocks
    FirstToken / Done          the user's TTFT is the decode leg's first token; E2E
                               spans both legs

``T = kv_transfer_time_s(prompt - 1, decode engine's KV bytes per token per GPU,
link_for(decode GPU, its kv_link))`` (``engine/transfer.py``), what the decode twin
waits. Failover, as the live gateway: a failed prefill leg is retried on the next
prefill backend; when none is left (a retryable failure) the whole request runs on the
decode backends first, then the unsplit ranking (``fallback``); a decode leg that fails
before its first token is retried on the next decode backend (pulling the KV again);
when none is left, the whole request runs on the unsplit ranking without the failed
decode backends (``fallback``). KV no decode engine pulled is freed at the prefill
engine's hold timeout. Not modelled: a transfer from a prefill engine that died
meanwhile, and contention between transfers on one link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiloserve.engine.transfer import KvLink, kv_transfer_time_s
from kiloserve.sim.backend import SimBackend

__all__ = ["HOLD_TIMEOUT_S", "SimDisagg", "kv_tier_summary"]

# A prefill engine frees held blocks nobody pulled after this long (vLLM's
# VLLM_NIXL_ABORT_REQUEST_TIMEOUT default; the twin's --kv-hold-timeout-s).
HOLD_TIMEOUT_S = 480.0


class SimDisagg:
    """Each backend's KV link and bytes per token, and the split counts of one run."""

    def __init__(self, backends: Sequence[SimBackend]) -> None:
        self._links: list[KvLink | None] = [b.model.kv_link for b in backends]
        self._bytes_per_token = [b.model.engine_config.kv_bytes_per_token for b in backends]
        # the live gateway's kiloserve_gateway_disagg_requests_total{mode} counts
        self.num_split = 0  # served by a decode leg (its first token reached the gateway)
        self.num_colocated = 0  # kept whole by the rule (the model has P/D backends)
        self.num_fallback = 0  # split, but every prefill (or decode) leg failed: whole
        self.num_releases = 0  # prefill holds freed (by a decode engine, or timed out)

    def transfer_s(self, decode_index: int, num_tokens: int) -> float:
        """Seconds the decode backend ``decode_index`` takes to pull ``num_tokens``."""
        link = self._links[decode_index]
        if link is None:
            raise RuntimeError("a decode backend without a KV link")  # a simulator bug
        return kv_transfer_time_s(num_tokens, self._bytes_per_token[decode_index], link)

    def describe(self) -> dict[str, Any]:
        """The summary's ``disagg`` block."""
        return {
            "split": self.num_split,
            "colocated": self.num_colocated,
            "fallback": self.num_fallback,
            "kv_releases": self.num_releases,
        }


def kv_tier_summary(backends: Sequence[SimBackend]) -> dict[str, Any] | None:
    """The KV tiers' counters summed over the engines that have one (None: no tier).

    Hit rates are tokens loaded back from a tier over the tokens looked up in the
    tiers (every token of each sequence admitted with a tier lookup, not only the GPU
    misses, re-admissions too); engines that died lose their
    counters, as their prefix-cache counters do.
    """
    tiered = [b for b in backends if b.model.engine_config.has_kv_tiers]
    if not tiered:
        return None
    queries = cpu_hits = remote_hits = cpu_offloaded = remote_offloaded = loaded = 0
    load_s = 0.0
    for backend in tiered:
        core = backend.core
        if core is None:
            continue
        queries += core.kv_tier_queries_tokens
        cpu_hits += core.kv_cpu_hit_tokens
        remote_hits += core.kv_remote_hit_tokens
        cpu_offloaded += core.kv_cpu_offloaded_blocks
        remote_offloaded += core.kv_remote_offloaded_blocks
        loaded += core.kv_loaded_bytes
        load_s += core.kv_load_s_total
    return {
        "num_backends": len(tiered),
        "queries_tokens": queries,
        "cpu_hit_tokens": cpu_hits,
        "remote_hit_tokens": remote_hits,
        "cpu_hit_rate": cpu_hits / queries if queries else None,
        "remote_hit_rate": remote_hits / queries if queries else None,
        "cpu_offloaded_blocks": cpu_offloaded,
        "remote_offloaded_blocks": remote_offloaded,
        "loaded_bytes": loaded,
        "load_s": load_s,
    }
