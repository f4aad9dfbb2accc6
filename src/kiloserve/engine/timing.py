"""Step-time model: how long one continuous-batching engine step takes on a GPU.

A roofline with fitted fixed costs (data/calibration.md, docs/engine-model.md):

    prefill chunk (T new tokens over P cached):
        FLOPs = 2 N T + 4 L h_q d T (P + T/2) + 2 hidden vocab
    decode of B sequences with contexts c_i:
        FLOPs = 2 N B + 4 L h_q d sum(c_i)
    bytes per GPU = weights / tp + KV bytes/token/GPU x (sum(c_i) + sum(P + T))
    step = max(prefill FLOPs / (tp peak prefill_mfu) + decode FLOPs / (tp peak decode_mfu),
               bytes / (bandwidth x 0.73))
           + 126 us + 32 us x layers + 4.4 us x requests            (BLIS fixed costs)
           + TP>1: 2 all-reduces per layer, each 30 us x log2(tp)
                   + tokens x hidden x 2 B x 2 (tp-1)/tp / (link bandwidth x 0.75)

N is the parameter count, L layers, h_q query heads, d head_dim. fp8 quantisation
computes at the card's fp8 peak; int8/int4 are weight-only (bf16 compute, fewer bytes).
Every term grows with batch and context, and every factor is <= 1, so a step is
never faster than ``roofline_bound_s`` (no overheads, 100% MFU and bandwidth).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiloserve.catalog import GpuSpec, ModelSpec, normalize_name, weight_bytes_per_param
from kiloserve.errors import ConfigError

__all__ = [
    "ALLREDUCE_BUS_EFFICIENCY",
    "ALLREDUCE_LATENCY_S",
    "LAYER_OVERHEAD_S",
    "PER_REQUEST_API_OVERHEAD_S",
    "PER_TOKEN_STREAM_OVERHEAD_S",
    "REQUEST_OVERHEAD_S",
    "STEP_OVERHEAD_S",
    "WEIGHT_BANDWIDTH_EFFICIENCY",
    "StepTimeModel",
]

STEP_OVERHEAD_S = 126e-6  # scheduler + launch cost per step (BLIS fit)
LAYER_OVERHEAD_S = 32e-6  # per layer per step (BLIS fit)
REQUEST_OVERHEAD_S = 4.4e-6  # per request in the batch per step (BLIS fit)
WEIGHT_BANDWIDTH_EFFICIENCY = 0.73  # achieved fraction of peak HBM bandwidth
ALLREDUCE_LATENCY_S = 30e-6  # per all-reduce per log2(tp) (fit: SplitwiseSim TP2/TP4)
ALLREDUCE_BUS_EFFICIENCY = 0.75  # achieved fraction of link bandwidth (BLIS TP x0.75)
NUM_ALLREDUCES_PER_LAYER = 2  # after attention and after the MLP (Megatron TP)
ACTIVATION_BYTES_PER_ELEMENT = 2  # bf16 hidden states on the wire
PER_REQUEST_API_OVERHEAD_S = 0.015  # HTTP + tokenise + detokenise, once per request
PER_TOKEN_STREAM_OVERHEAD_S = 46e-6  # per streamed token (SSE chunk), not in steps


class StepTimeModel:
    """Seconds per engine step for one model replica (``tp`` GPUs) on ``gpu``."""

    per_request_api_overhead_s: float = PER_REQUEST_API_OVERHEAD_S
    per_token_stream_overhead_s: float = PER_TOKEN_STREAM_OVERHEAD_S

    def __init__(
        self,
        gpu: GpuSpec,
        model: ModelSpec,
        tp: int = 1,
        quant: str = "bf16",
        kv_dtype: str = "bf16",
    ) -> None:
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        self.gpu, self.model, self.tp = gpu, model, tp
        self.quant, self.kv_dtype = normalize_name(quant), normalize_name(kv_dtype)
        weight_bytes = model.num_params * weight_bytes_per_param(self.quant)
        peak_flops = tp * gpu.peak_flops(self.quant)
        self._flops_per_token = 2.0 * model.num_params
        self._attention_flops = 4.0 * model.num_layers * model.num_attention_heads * model.head_dim
        self._lm_head_flops = 2.0 * model.hidden_size * model.vocab_size
        self._peak_flops = peak_flops
        self._prefill_flops_rate = peak_flops * gpu.prefill_mfu
        self._decode_flops_rate = peak_flops * gpu.decode_mfu
        self._weight_bytes = weight_bytes / tp
        self._kv_bytes = float(model.kv_bytes_per_token_per_gpu(tp, self.kv_dtype))
        self._peak_bandwidth = gpu.bandwidth_tbs * 1e12
        self._bandwidth = self._peak_bandwidth * WEIGHT_BANDWIDTH_EFFICIENCY
        self._fixed_s = STEP_OVERHEAD_S + LAYER_OVERHEAD_S * model.num_layers
        self._fixed_s += self._compute_allreduce_latency_s()
        self._allreduce_s_per_token = self._compute_allreduce_s_per_token()

    def _compute_allreduce_latency_s(self) -> float:
        if self.tp == 1:
            return 0.0
        num_allreduces = NUM_ALLREDUCES_PER_LAYER * self.model.num_layers
        return num_allreduces * ALLREDUCE_LATENCY_S * math.log2(self.tp)

    def _compute_allreduce_s_per_token(self) -> float:
        """Ring all-reduce transfer time per token in the step (0 at TP1)."""
        if self.tp == 1:
            return 0.0
        num_allreduces = NUM_ALLREDUCES_PER_LAYER * self.model.num_layers
        token_bytes = self.model.hidden_size * ACTIVATION_BYTES_PER_ELEMENT
        wire_bytes = token_bytes * 2.0 * (self.tp - 1) / self.tp
        link_bytes_per_s = self.gpu.link_bandwidth_gbs * 1e9 * ALLREDUCE_BUS_EFFICIENCY
        return num_allreduces * wire_bytes / link_bytes_per_s

    def _prefill_totals(self, prefill: Sequence[tuple[int, int]]) -> tuple[float, int, int]:
        """(FLOPs, KV tokens touched, new tokens) of the prefill chunks."""
        flops = 0.0
        kv_tokens = 0
        new_tokens = 0
        for num_new, num_cached in prefill:
            flops += self._flops_per_token * num_new + self._lm_head_flops
            flops += self._attention_flops * num_new * (num_cached + num_new / 2.0)
            kv_tokens += num_cached + num_new
            new_tokens += num_new
        return flops, kv_tokens, new_tokens

    def step_time_s(
        self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """One scheduler step: prefill chunks as ``(new_tokens, cached_tokens)`` plus one
        decode token for each sequence whose current context length is listed."""
        num_decodes = len(decode_contexts)
        if not prefill and not num_decodes:
            return 0.0
        prefill_flops, prefill_kv_tokens, prefill_tokens = self._prefill_totals(prefill)
        context_tokens = sum(decode_contexts)
        compute_s = prefill_flops / self._prefill_flops_rate
        decode_flops = self._flops_per_token * num_decodes + self._attention_flops * context_tokens
        compute_s += decode_flops / self._decode_flops_rate
        kv_tokens = context_tokens + prefill_kv_tokens
        memory_s = (self._weight_bytes + self._kv_bytes * kv_tokens) / self._bandwidth
        num_requests = len(prefill) + num_decodes
        overhead_s = self._fixed_s + REQUEST_OVERHEAD_S * num_requests
        overhead_s += self._allreduce_s_per_token * (prefill_tokens + num_decodes)
        return max(compute_s, memory_s) + overhead_s

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        """Total time of ``num_steps`` pure decode steps of a batch of ``num_seqs``
        sequences whose contexts sum to ``context_tokens``, each growing by one per
        step; equals summing ``step_time_s([], ...)``, in O(1)."""
        if num_steps <= 0 or num_seqs <= 0:
            return 0.0
        # compute(i) = c0 + c1 i and memory(i) = m0 + m1 i: total context grows by num_seqs.
        c0 = self._decode_compute_s(num_seqs, context_tokens)
        c1 = self._attention_flops * num_seqs / self._decode_flops_rate
        m0 = self._decode_memory_s(context_tokens)
        m1 = self._kv_bytes * num_seqs / self._bandwidth
        overhead_s = self._fixed_s + (REQUEST_OVERHEAD_S + self._allreduce_s_per_token) * num_seqs
        num_memory_bound = _num_steps_below(c0 - m0, c1 - m1, num_steps)
        if c1 - m1 < 0:  # compute-bound first, memory-bound later
            num_first = num_steps - num_memory_bound
            total = _series_sum(c0, c1, 0, num_first) + _series_sum(m0, m1, num_first, num_steps)
        else:
            num_first = num_memory_bound
            total = _series_sum(m0, m1, 0, num_first) + _series_sum(c0, c1, num_first, num_steps)
        return total + overhead_s * num_steps

    def _decode_compute_s(self, num_seqs: int, context_tokens: int) -> float:
        flops = self._flops_per_token * num_seqs + self._attention_flops * context_tokens
        return flops / self._decode_flops_rate

    def _decode_memory_s(self, context_tokens: int) -> float:
        return (self._weight_bytes + self._kv_bytes * context_tokens) / self._bandwidth

    def roofline_bound_s(
        self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """Pure roofline: max(FLOPs / peak, bytes / peak bandwidth); no overheads."""
        num_decodes = len(decode_contexts)
        if not prefill and not num_decodes:
            return 0.0
        prefill_flops, prefill_kv_tokens, _ = self._prefill_totals(prefill)
        context_tokens = sum(decode_contexts)
        flops = prefill_flops + self._flops_per_token * num_decodes
        flops += self._attention_flops * context_tokens
        kv_tokens = context_tokens + prefill_kv_tokens
        num_bytes = self._weight_bytes + self._kv_bytes * kv_tokens
        return max(flops / self._peak_flops, num_bytes / self._peak_bandwidth)


def _num_steps_below(d0: float, d1: float, num_steps: int) -> int:
    """How many i in [0, num_steps) have d0 + d1 i < 0 (a line crosses zero once)."""
    if d1 == 0:
        return num_steps if d0 < 0 else 0
    root = -d0 / d1
    if d1 > 0:  # negative before the root
        return min(num_steps, max(0, math.ceil(root)))
    # negative after the root
    return num_steps - min(num_steps, max(0, math.floor(root) + 1))


def _series_sum(a0: float, a1: float, start: int, stop: int) -> float:
    """sum(a0 + a1 i for i in range(start, stop)) in O(1)."""
    n = stop - start
    if n <= 0:
        return 0.0
    return n * a0 + a1 * (start + stop - 1) * n / 2.0
