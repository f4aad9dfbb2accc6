"""The per-GPU memory ledger: weights, activations, runtime, and what is left for KV.

Formula (vLLM's start-up profile, figures in data/calibration.md):

    usable      = memory x gpu_memory_utilization (0.92)
    kv_bytes    = usable - weights / tp - activations (5.5 GiB) - runtime
                  (0.15 GiB at TP1, 0.6 GiB per GPU at TP>1: NCCL buffers, CUDA graphs)
    num_blocks  = floor(kv_bytes / (block_size x KV bytes per token per GPU))

KV heads shard across TP (per-GPU KV bytes/token = total / tp when kv_heads >= tp;
with fewer KV heads than GPUs each GPU keeps one replicated head). A configuration
fits when the weights fit and the KV cache holds at least one ``max_model_len``-token
sequence (vLLM refuses to start otherwise). ``plan_memory`` raises
``DoesNotFitError`` naming what would fit (a larger power-of-two TP, or a smaller
quantisation), found by ``smallest_fitting``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.catalog import (
    GIB,
    GpuSpec,
    ModelSpec,
    normalize_name,
    weight_bytes_per_param,
)
from kiloserve.errors import ConfigError, DoesNotFitError

__all__ = [
    "ACTIVATION_BYTES",
    "MAX_TP",
    "QUANT_PREFERENCE",
    "FitSuggestion",
    "MemoryLedger",
    "build_ledger",
    "plan_memory",
    "smallest_fitting",
]

ACTIVATION_BYTES = int(5.5 * GIB)
RUNTIME_BYTES_TP1 = int(0.15 * GIB)
RUNTIME_BYTES_PER_GPU_TP = int(0.6 * GIB)
MAX_TP = 8
# Quantisations tried when suggesting one, most precise first.
QUANT_PREFERENCE: tuple[str, ...] = ("bf16", "fp8", "int8", "int4")


@dataclass(frozen=True, slots=True)
class MemoryLedger:
    """Where one GPU's memory goes for ``model`` at ``tp`` / ``quant`` / ``kv_dtype``."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int
    quant: str
    kv_dtype: str
    gpu_memory_utilization: float
    block_size: int
    memory_bytes_per_gpu: int
    weight_bytes_per_gpu: int
    activation_bytes: int
    runtime_bytes: int
    kv_bytes_per_token_per_gpu: int
    num_kv_blocks: int
    kv_capacity_tokens: int
    max_model_len: int

    @property
    def usable_bytes_per_gpu(self) -> int:
        """Memory vLLM may use: ``memory x gpu_memory_utilization``."""
        return int(self.memory_bytes_per_gpu * self.gpu_memory_utilization)

    @property
    def free_kv_bytes_per_gpu(self) -> int:
        """Bytes left for the KV cache (negative when the weights do not fit)."""
        fixed = self.weight_bytes_per_gpu + self.activation_bytes + self.runtime_bytes
        return self.usable_bytes_per_gpu - fixed

    @property
    def kv_cache_bytes_per_gpu(self) -> int:
        """Bytes taken by the allocated KV blocks."""
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token_per_gpu

    @property
    def is_weights_fitting(self) -> bool:
        return self.weight_bytes_per_gpu + self.activation_bytes + self.runtime_bytes <= (
            self.usable_bytes_per_gpu
        )

    @property
    def is_fitting(self) -> bool:
        """Weights fit and the KV cache holds one ``max_model_len`` sequence."""
        return self.is_weights_fitting and self.kv_capacity_tokens >= self.max_model_len

    def max_num_full_sequences(self) -> int:
        """How many ``max_model_len``-token sequences fit in the KV cache at once."""
        return self.kv_capacity_tokens // self.max_model_len

    def summary(self) -> str:
        """Human-readable ledger, one line per item, GiB per GPU."""

        def gib(num_bytes: int) -> str:
            return f"{num_bytes / GIB:8.2f} GiB"

        return "\n".join(
            [
                f"{self.model.name} {self.quant} on {self.tp} x {self.gpu.name} "
                f"(KV {self.kv_dtype}, block {self.block_size}), per GPU:",
                f"  memory            {gib(self.memory_bytes_per_gpu)}",
                f"  usable (x{self.gpu_memory_utilization:g})   {gib(self.usable_bytes_per_gpu)}",
                f"  weights           {gib(self.weight_bytes_per_gpu)}",
                f"  activations       {gib(self.activation_bytes)}",
                f"  runtime           {gib(self.runtime_bytes)}",
                f"  KV cache          {gib(self.kv_cache_bytes_per_gpu)}"
                f"  = {self.num_kv_blocks} blocks = {self.kv_capacity_tokens:,} tokens"
                f" ({self.kv_bytes_per_token_per_gpu:,} B/token/GPU)",
                f"  full {self.max_model_len:,}-token sequences: {self.max_num_full_sequences()}",
            ]
        )


@dataclass(frozen=True, slots=True)
class FitSuggestion:
    """What would fit: ``tp`` (smallest power of two <= 8 at the asked quantisation)
    and ``quant`` (most precise quantisation at the asked TP); None where nothing does."""

    tp: int | None
    quant: str | None


def _validate(
    model: ModelSpec, tp: int, utilization: float, block_size: int, max_model_len: int | None
) -> None:
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    if model.num_attention_heads % tp:
        raise ConfigError(
            f"tp {tp} does not divide {model.name}'s {model.num_attention_heads} attention heads"
        )
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")


def build_ledger(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int = 1,
    quant: str = "bf16",
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.92,
    block_size: int = 16,
    max_model_len: int | None = None,
) -> MemoryLedger:
    """The ledger without the fit check (``num_kv_blocks`` is 0 when nothing is left)."""
    _validate(model, tp, gpu_memory_utilization, block_size, max_model_len)
    quant_key, kv_key = normalize_name(quant), normalize_name(kv_dtype)
    weight_bytes = int(model.num_params * weight_bytes_per_param(quant_key))
    weight_bytes_per_gpu = -(-weight_bytes // tp)  # ceil
    kv_per_token = model.kv_bytes_per_token_per_gpu(tp, kv_key)  # validates kv_dtype
    runtime = RUNTIME_BYTES_TP1 if tp == 1 else RUNTIME_BYTES_PER_GPU_TP
    memory = gpu.memory_bytes
    usable = int(memory * gpu_memory_utilization)
    free = usable - weight_bytes_per_gpu - ACTIVATION_BYTES - runtime
    num_blocks = max(0, free // (block_size * kv_per_token))
    return MemoryLedger(
        gpu=gpu,
        model=model,
        tp=tp,
        quant=quant_key,
        kv_dtype=kv_key,
        gpu_memory_utilization=gpu_memory_utilization,
        block_size=block_size,
        memory_bytes_per_gpu=memory,
        weight_bytes_per_gpu=weight_bytes_per_gpu,
        activation_bytes=ACTIVATION_BYTES,
        runtime_bytes=runtime,
        kv_bytes_per_token_per_gpu=kv_per_token,
        num_kv_blocks=num_blocks,
        kv_capacity_tokens=num_blocks * block_size,
        max_model_len=max_model_len or model.max_model_len,
    )


def smallest_fitting(
    gpu: GpuSpec,
    model: ModelSpec,
    quant: str = "bf16",
    tp: int = 1,
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.92,
    block_size: int = 16,
    max_model_len: int | None = None,
) -> FitSuggestion:
    """Smallest power-of-two TP <= 8 that fits at ``quant``; most precise quantisation
    (bf16 > fp8 > int8 > int4) that fits at ``tp``."""

    def is_fitting(tp_: int, quant_: str) -> bool:
        if model.num_attention_heads % tp_:
            return False
        ledger = build_ledger(
            gpu, model, tp_, quant_, kv_dtype, gpu_memory_utilization, block_size, max_model_len
        )
        return ledger.is_fitting

    tps = [t for t in (1, 2, 4, 8) if t <= MAX_TP]
    fit_tp = next((t for t in tps if is_fitting(t, quant)), None)
    fit_quant = next((q for q in QUANT_PREFERENCE if is_fitting(tp, q)), None)
    return FitSuggestion(tp=fit_tp, quant=fit_quant)


def _advice(ledger: MemoryLedger, suggestion: FitSuggestion) -> str:
    options = []
    if suggestion.tp is not None and suggestion.tp != ledger.tp:
        options.append(f"--tp {suggestion.tp}")
    if suggestion.quant is not None and suggestion.quant != ledger.quant:
        options.append(f"--quant {suggestion.quant}")
    if not options:
        return f"no TP up to {MAX_TP} and no quantisation fits; use a larger GPU"
    return "use " + " or ".join(options)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.0f} GB" if num_bytes >= 10e9 else f"{num_bytes / 1e9:.1f} GB"


def _does_not_fit_message(ledger: MemoryLedger, suggestion: FitSuggestion) -> str:
    name = f"{ledger.model.name} {ledger.quant}"
    gpu = f"{ledger.gpu.name} has {ledger.gpu.memory_gb:g} GB"
    advice = _advice(ledger, suggestion)
    if not ledger.is_weights_fitting:
        total = ledger.model.num_params * weight_bytes_per_param(ledger.quant)
        if ledger.tp == 1:
            return f"{name} needs {_gb(total)} of weights; one {gpu}: {advice}"
        per_gpu = _gb(ledger.weight_bytes_per_gpu)
        return (
            f"{name} needs {_gb(total)} of weights ({per_gpu} per GPU at TP{ledger.tp}); "
            f"each {gpu}: {advice}"
        )
    needed = ledger.max_model_len * ledger.kv_bytes_per_token_per_gpu
    free = max(0, ledger.free_kv_bytes_per_gpu)
    return (
        f"{name} weights fit at TP{ledger.tp} on {ledger.gpu.name} but only {_gb(free)} per "
        f"GPU is left for the KV cache; one {ledger.max_model_len}-token sequence needs "
        f"{_gb(needed)} ({_gb(needed - free)} missing): {advice} (or lower --max-model-len)"
    )


def plan_memory(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int = 1,
    quant: str = "bf16",
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.92,
    block_size: int = 16,
    max_model_len: int | None = None,
) -> MemoryLedger:
    """The memory ledger; raises ``DoesNotFitError`` (saying what would fit) if the
    weights do not fit or the KV cache cannot hold one ``max_model_len`` sequence."""
    ledger = build_ledger(
        gpu, model, tp, quant, kv_dtype, gpu_memory_utilization, block_size, max_model_len
    )
    if ledger.is_fitting:
        return ledger
    suggestion = smallest_fitting(
        gpu,
        model,
        ledger.quant,
        tp,
        kv_dtype,
        gpu_memory_utilization,
        block_size,
        max_model_len,
    )
    raise DoesNotFitError(_does_not_fit_message(ledger, suggestion))
