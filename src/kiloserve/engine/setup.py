"""One recipe for an engine's configuration, shared by the twin and the simulator.

The memory ledger gives the KV blocks (and the effective ``max_model_len``); vLLM's
per-GPU defaults give ``max_num_seqs`` / ``max_num_batched_tokens`` unless overridden.
"""

from __future__ import annotations

from kiloserve.catalog import GpuSpec, ModelSpec
from kiloserve.catalog.memory import MemoryLedger, plan_memory
from kiloserve.engine.config import EngineConfig
from kiloserve.errors import ConfigError

__all__ = ["engine_config_for"]


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
) -> tuple[EngineConfig, MemoryLedger]:
    """The engine config and the ledger it came from; raises ``DoesNotFitError``.

    ``num_gpu_blocks_override`` replaces the ledger's KV block count (null block
    included), as vLLM's flag of that name does; requests that need more blocks than
    there are get a 400 (``EngineCore`` checks each one).
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
    )
    return config, ledger
