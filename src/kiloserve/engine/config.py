"""Static limits of one modelled engine (the knobs vLLM exposes with the same names)."""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.errors import ConfigError

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and batching limits of one engine.

    ``num_blocks`` counts every KV block, including the null block vLLM reserves, so
    ``num_blocks - 1`` blocks hold tokens. ``long_prefill_token_threshold`` caps the
    tokens one sequence may prefill per step (0 = no cap beyond the step budget).
    """

    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0

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

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold tokens (all but the null block)."""
        return self.num_blocks - 1


def _require_at_least(key: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
