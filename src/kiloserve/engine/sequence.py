"""One request inside the modelled engine: its tokens, progress and KV blocks.

No model runs here: a token is an int. Output tokens are deterministic filler (the
ids of `` word`` pieces of :data:`kiloserve.tokens.FILLER_WORDS`, picked by output
position) unless the caller plans them, so generated blocks hash like any other and
the prefix cache can reuse them. Timestamps are the caller's business.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from kiloserve.tokens import FILLER_WORDS, block_hashes, tokenize

__all__ = [
    "Sequence",
    "SequenceStatus",
    "chain_block_hash",
    "output_token_id",
    "output_word",
]

_WORD_STRIDE = 31
_OUTPUT_WORD_IDS: tuple[int, ...] = tuple(tokenize(" " + word)[0] for word in FILLER_WORDS)


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def output_word(index: int) -> str:
    """The filler word (with its leading space) generated at output position ``index``."""
    return " " + FILLER_WORDS[(index * _WORD_STRIDE) % len(FILLER_WORDS)]


def output_token_id(index: int) -> int:
    """Token id of :func:`output_word` (``tokenize(output_word(i))[0]``)."""
    return _OUTPUT_WORD_IDS[(index * _WORD_STRIDE) % len(_OUTPUT_WORD_IDS)]


def chain_block_hash(prev_hash: int, block_token_ids: list[int]) -> int:
    """Extend a chained hash by one full block (same formula as ``tokens.block_hashes``)."""
    data = prev_hash.to_bytes(8, "little") + b"".join(
        t.to_bytes(4, "little") for t in block_token_ids
    )
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's state in the engine; mutated only by the scheduler and block manager.

    ``max_tokens`` is the number of output tokens to produce; on reaching it the
    sequence finishes with ``stop_reason`` ("length" or "stop"). ``block_hashes``
    holds the chained hash of every full block of prompt + output tokens.
    """

    seq_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    stop_reason: str = "length"
    planned_output_token_ids: list[int] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the cache
    block_size: int = 16

    def __post_init__(self) -> None:
        self.block_hashes = block_hashes(self.prompt_token_ids, self.block_size)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_output_tokens(self) -> int:
        return self.max_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Prompt done and only the last generated token left to compute."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    def append_output_tokens(self, num_tokens: int) -> None:
        """Generate the next ``num_tokens`` output tokens and hash newly full blocks."""
        start = len(self.output_token_ids)
        self.output_token_ids.extend(self._next_token_ids(start, num_tokens))
        self._hash_new_blocks()

    def _next_token_ids(self, start: int, num_tokens: int) -> Iterator[int] | list[int]:
        planned = self.planned_output_token_ids
        if planned is not None and len(planned) >= start + num_tokens:
            return planned[start : start + num_tokens]
        return (output_token_id(i) for i in range(start, start + num_tokens))

    def _hash_new_blocks(self) -> None:
        size = self.block_size
        num_full = self.num_tokens // size
        num_prompt = len(self.prompt_token_ids)
        while len(self.block_hashes) < num_full:
            begin = len(self.block_hashes) * size
            if begin >= num_prompt:
                chunk = self.output_token_ids[begin - num_prompt : begin - num_prompt + size]
            else:
                chunk = (
                    self.prompt_token_ids[begin:]
                    + self.output_token_ids[: begin + size - num_prompt]
                )
            prev = self.block_hashes[-1] if self.block_hashes else 0
            self.block_hashes.append(chain_block_hash(prev, chunk))
