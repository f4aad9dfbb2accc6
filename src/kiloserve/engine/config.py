"""Static limits of one modelled engine (the knobs vLLM exposes with the same names)."""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.errors import ConfigError

__all__ = ["ROLES", "EngineConfig"]

ROLES = ("prefill", "decode", "both")  # an engine's part in disaggregated serving


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and batching limits of one engine.

    ``num_blocks`` counts every KV block, including the null block vLLM reserves, so
    ``num_blocks - 1`` blocks hold tokens. ``long_prefill_token_threshold`` caps the
    tokens one sequence may prefill per step (0 = no cap beyond the step budget).

    Disaggregated serving and KV tiers (docs/engine-model.md, "Disaggregation and KV
    tiers"): ``role`` is the engine's part (``prefill``, ``decode`` or ``both``; the
    core schedules every role alike, the twin and the simulator act on it).
    ``kv_cpu_blocks`` / ``kv_remote_blocks`` are the capacities, in blocks of
    ``block_size`` tokens, of the CPU and remote tiers behind the GPU prefix cache
    (0 = no tier: today's code paths); a block loaded back from a tier costs
    ``kv_bytes_per_block / kv_cpu_bandwidth_bps`` (or the remote bandwidth) seconds.
    ``kv_bytes_per_block`` is per GPU (one TP rank's shard: ranks move their shards
    in parallel, each over its own link); 0 = unknown (allowed only without tiers).
    """

    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    role: str = "both"
    kv_cpu_blocks: int = 0
    kv_remote_blocks: int = 0
    kv_cpu_bandwidth_bps: float = 0.0
    kv_remote_bandwidth_bps: float = 0.0
    kv_bytes_per_block: int = 0

    def __post_init__(self) -> None:
        _require_at_least("num_blocks", self.num_blocks, 2)
        _require_at_least("block_size", self.block_size, 1)
        _require_at_least("max_num_seqs", self.max_num_seqs, 1)
        _require_at_least("max_model_len", self.max_model_len, 1)
        _require_at_least("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        _require_at_least("kv_cpu_blocks", self.kv_cpu_blocks, 0)
        _require_at_least("kv_remote_blocks", self.kv_remote_blocks, 0)
        _require_at_least("kv_bytes_per_block", self.kv_bytes_per_block, 0)
        self._check_tier("kv_cpu", self.kv_cpu_blocks, self.kv_cpu_bandwidth_bps)
        self._check_tier("kv_remote", self.kv_remote_blocks, self.kv_remote_bandwidth_bps)

    def _check_tier(self, name: str, num_blocks: int, bandwidth_bps: float) -> None:
        if not (isinstance(bandwidth_bps, int | float) and bandwidth_bps >= 0):
            raise ConfigError(f"{name}_bandwidth_bps must be >= 0, got {bandwidth_bps!r}")
        if num_blocks and not (bandwidth_bps > 0 and self.kv_bytes_per_block > 0):
            raise ConfigError(
                f"{name}_blocks needs {name}_bandwidth_bps > 0 and kv_bytes_per_block > 0"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on one GPU (``kv_bytes_per_block / block_size``)."""
        return self.kv_bytes_per_block // self.block_size

    @property
    def has_kv_tiers(self) -> bool:
        """Whether a CPU or remote tier is configured."""
        return self.kv_cpu_blocks > 0 or self.kv_remote_blocks > 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.num_blocks - 1


def _require_at_least(key: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
