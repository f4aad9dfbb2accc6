"""One recipe for an engine's configuration, shared by the twin and the simulator.

The memory ledger gives the KV blocks (and the effective ``max_model_len``); vLLM's
per-GPU defaults give ``max_num_seqs`` / ``max_num_batched_tokens`` unless overridden.

KV tiers: ``kv_cpu_gib`` / ``kv_remote_gib`` are sizes for the whole engine, summed
over its TP ranks (as vLLM's ``--kv-offloading-size``), turned into blocks by
``tier_blocks``. A tier block holds the KV of ``block_size`` tokens on every rank.
The CPU tier is read over the GPU's PCIe link, the remote tier over its NIC.
"""

from __future__ import annotations

import math

from kiloserve.catalog import GIB, GpuSpec, ModelSpec
from kiloserve.catalog.memory import MemoryLedger, plan_memory
from kiloserve.engine.config import EngineConfig
from kiloserve.errors import ConfigError

__all__ = ["engine_config_for", "tier_blocks"]


def tier_blocks(size_gib: float, ledger: MemoryLedger) -> int:
    """Blocks a KV tier of ``size_gib`` GiB (all TP ranks together) holds."""
    if isinstance(size_gib, bool) or not (math.isfinite(size_gib) and size_gib >= 0):
        raise ConfigError(f"KV tier size must be a finite number of GiB >= 0, got {size_gib!r}")
    bytes_per_block = ledger.block_size * ledger.kv_bytes_per_token_per_gpu * ledger.tp
    return int(size_gib * GIB) // bytes_per_block


def engine_config_for(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int = 1,
    quant: str = "bf16",
    *,
    gpu_memory_utilization: float = 0.92,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    num_gpu_blocks_override: int | None = None,
    kv_cpu_gib: float = 0.0,
    kv_remote_gib: float = 0.0,
    role: str = "both",
) -> tuple[EngineConfig, MemoryLedger]:
    """The engine config and the ledger it came from; raises ``DoesNotFitError``.

    ``num_gpu_blocks_override`` replaces the ledger's KV block count (null block
    included), as vLLM's flag of that name does; requests that need more blocks than
    there are get a 400 (``EngineCore`` checks each one). ``kv_cpu_gib`` /
    ``kv_remote_gib`` size the KV tiers (``tier_blocks``); ``role`` is the engine's
    part in disaggregated serving (prefill, decode or both).
    """
    override = num_gpu_blocks_override
    if override is not None and override < 2:
        raise ConfigError(f"num_gpu_blocks_override must be >= 2, got {override}")
    ledger = plan_memory(
        gpu,
        model,
        tp,
        quant,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
    )
    config = EngineConfig(
        num_blocks=ledger.num_kv_blocks if override is None else override,
        max_num_seqs=max_num_seqs or gpu.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or gpu.max_num_batched_tokens,
        max_model_len=ledger.max_model_len,
        block_size=ledger.block_size,
        role=role,
        kv_cpu_blocks=tier_blocks(kv_cpu_gib, ledger),
        kv_remote_blocks=tier_blocks(kv_remote_gib, ledger),
        kv_cpu_bandwidth_bps=gpu.pcie_bandwidth_gbs * 1e9,
        kv_remote_bandwidth_bps=gpu.network_bandwidth_gbs * 1e9,
        kv_bytes_per_block=ledger.block_size * ledger.kv_bytes_per_token_per_gpu,
    )
    return config, ledger
