"""GPU and model specifications, quantisation and KV-cache byte sizes.

Two frozen dataclasses describe what the memory ledger and the step-time model need:
``GpuSpec`` (peak compute, bandwidth, memory, efficiency factors, cost, vLLM per-GPU
scheduler defaults) and ``ModelSpec`` (the figures of a Hugging Face ``config.json``).

Units: ``memory_gb`` is the card's nominal size and is read as GiB (HBM and GDDR
stacks are power-of-two sized; an "80 GB" H100 reports ~79.6 GiB to the driver);
``bandwidth_tbs`` is TB/s (1e12 bytes/s); ``tflops_*`` are dense (non-sparse) TFLOPS;
``link_bandwidth_gbs`` is the per-direction GPU-to-GPU bandwidth used for the
tensor-parallel all-reduce (NVLink / Infinity Fabric / PCIe), in GB/s (1e9 bytes/s);
``network_bandwidth_gbs`` is one GPU's share of the scale-out network (its NIC: 400
Gb/s InfiniBand/RoCE = 50 GB/s), over which a decode engine pulls KV from a prefill
engine; ``pcie_bandwidth_gbs`` is the host link (PCIe Gen5 x16 64, Gen4 x16 32, Gen3
x16 16 GB/s), over which KV moves to and from a CPU tier. Both per direction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kiloserve.errors import CatalogError

__all__ = [
    "GIB",
    "KV_DTYPES",
    "QUANTS",
    "GpuSpec",
    "ModelSpec",
    "kv_bytes_per_element",
    "normalize_name",
    "weight_bytes_per_param",
]

GIB = 1 << 30

# Bytes per weight parameter for each quantisation (``--quant``).
QUANTS: Mapping[str, float] = MappingProxyType(
    {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
)
# Bytes per KV-cache element for each KV dtype (``--kv-dtype``); "auto" = model dtype.
KV_DTYPES: Mapping[str, int] = MappingProxyType({"bf16": 2, "fp16": 2, "auto": 2, "fp8": 1})


def normalize_name(name: str) -> str:
    """Lookup key: lower case, ``_`` and spaces read as ``-``."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def weight_bytes_per_param(quant: str) -> float:
    """Bytes per parameter for ``quant`` (bf16/fp16 2, fp8/int8 1, int4 0.5)."""
    key = normalize_name(quant)
    if key not in QUANTS:
        raise CatalogError(f"unknown quantisation {quant!r}; valid: {', '.join(QUANTS)}")
    return QUANTS[key]


def kv_bytes_per_element(kv_dtype: str) -> int:
    """Bytes per KV-cache element for ``kv_dtype`` (bf16/fp16/auto 2, fp8 1)."""
    key = normalize_name(kv_dtype)
    if key not in KV_DTYPES:
        raise CatalogError(f"unknown KV dtype {kv_dtype!r}; valid: {', '.join(KV_DTYPES)}")
    return KV_DTYPES[key]


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator: peak figures, efficiency factors, list price, vLLM defaults."""

    name: str
    aliases: tuple[str, ...]
    tflops_bf16: float
    tflops_fp8: float | None
    bandwidth_tbs: float
    memory_gb: float
    prefill_mfu: float
    decode_mfu: float
    cost_per_hour: float
    max_num_batched_tokens: int
    max_num_seqs: int
    link_bandwidth_gbs: float = 300.0
    network_bandwidth_gbs: float = 25.0  # 200 Gb/s NIC per GPU unless the entry says
    pcie_bandwidth_gbs: float = 32.0  # PCIe Gen4 x16 unless the entry says

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (``memory_gb`` read as GiB)."""
        return int(self.memory_gb * GIB)

    @property
    def prefill_tflops(self) -> float:
        """Effective dense BF16 prefill TFLOPS of one GPU (``tflops_bf16 x prefill_mfu``):
        the step-time model's compute-bound prefill rate (``engine/timing.py``), per GPU."""
        return self.tflops_bf16 * self.prefill_mfu

    def peak_flops(self, quant: str = "bf16") -> float:
        """Dense peak FLOP/s for ``quant``: fp8 uses the fp8 peak where the card has one.

        int8/int4 are treated as weight-only quantisation (bf16 matmuls).
        """
        if normalize_name(quant) == "fp8" and self.tflops_fp8 is not None:
            return self.tflops_fp8 * 1e12
        return self.tflops_bf16 * 1e12


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A dense decoder-only transformer, as described by its ``config.json``."""

    name: str
    aliases: tuple[str, ...]
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    max_model_len: int

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV bytes per token over all GPUs: 2 x layers x kv_heads x head_dim x bytes."""
        element_bytes = kv_bytes_per_element(kv_dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    def kv_bytes_per_token_per_gpu(self, tp: int, kv_dtype: str = "bf16") -> int:
        """KV bytes per token on one GPU of a TP group.

        KV heads shard across TP; when ``num_kv_heads < tp`` each GPU keeps one
        (replicated) head, as vLLM does.
        """
        element_bytes = kv_bytes_per_element(kv_dtype)
        heads_per_gpu = math.ceil(self.num_kv_heads / tp)
        return 2 * self.num_layers * heads_per_gpu * self.head_dim * element_bytes

    def weight_bytes(self, quant: str = "bf16") -> int:
        """Total weight bytes under ``quant`` (every parameter at the same width)."""
        return int(self.num_params * weight_bytes_per_param(quant))
