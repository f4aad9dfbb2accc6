"""One request inside the modelled engine: its tokens, progress and KV blocks.

No model runs here: a token is an int. Output tokens are deterministic filler (the
ids of `` word`` pieces of :data:`kiloserve.tokens.FILLER_WORDS`, picked by output
position) unless the caller plans them, so generated blocks hash like any other and
the prefix cache can reuse them. Timestamps are the caller's business.
"""

from __future__ import annotations

import copy
import struct
import zlib
from enum import Enum
from typing import Any, Final

from kiloserve.tokens import FILLER_WORDS, tokenize

__all__ = [
    "Sequence",
    "SequenceStatus",
    "chain_block_hash",
    "output_token_id",
    "output_word",
]

_WORD_STRIDE = 31
_OUTPUT_WORD_IDS: tuple[int, ...] = tuple(tokenize(" " + word)[0] for word in FILLER_WORDS)
# output_token_id(i) repeats with period len(FILLER_WORDS); one period, in order
_OUTPUT_ID_CYCLE: tuple[int, ...] = tuple(
    _OUTPUT_WORD_IDS[(i * _WORD_STRIDE) % len(_OUTPUT_WORD_IDS)] for i in range(len(FILLER_WORDS))
)

_OUTPUT_ID_PERIOD = len(_OUTPUT_ID_CYCLE)
_OUTPUT_ID_CYCLE_TWICE: list[int] = list(_OUTPUT_ID_CYCLE) * 2  # any slice of <= 1 period


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
    data = struct.pack(f"<Q{len(block_token_ids)}I", prev_hash, *block_token_ids)
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


_SEQUENCE_ATTRS: Final = (
    "arrival_s",
    "block_hashes",
    "block_size",
    "block_table",
    "finish_reason",
    "free_segment_key",
    "hold_on_finish",
    "max_tokens",
    "num_cached_tokens",
    "num_computed_tokens",
    "num_hashed_blocks",
    "num_output_tokens",
    "num_preemptions",
    "num_tokens",
    "num_transferred_tokens",
    "planned_output_token_ids",
    "private_from_block",
    "prompt_token_ids",
    "seq_id",
    "status",
    "stop_reason",
)  # every attribute of a Sequence (its slots; copied by __deepcopy__)


class Sequence:
    """A request's state in the engine; mutated only by the scheduler and block manager.

    ``max_tokens`` is the number of output tokens to produce; on reaching it the
    sequence finishes with ``stop_reason`` ("length" or "stop"). ``block_hashes``
    holds the chained hash of every full block of prompt + output tokens.

    Output tokens are counted, not stored (``num_output_tokens``): their ids are a
    function of the position (planned, else filler), so ``output_token_ids`` builds
    them on demand and a fused run of k decode steps costs O(1), not O(k), until a
    block fills up and is hashed.

    ``private_from_block``: blocks from this index on hold text no other sequence has
    (None: any block may be shared); the block manager keeps them out of its hash
    index (see block_manager.py). A plain class, not a dataclass: the compiled build
    (mypyc) runs a dataclass's generated ``__init__`` as interpreted code.

    Disaggregated prefill/decode (P/D): ``num_transferred_tokens`` (decode side) is
    the number of leading prompt tokens whose KV arrived from a prefill engine: when
    the sequence is first scheduled they count as computed (blocks are allocated for
    them, no prefill compute, not a prefix-cache hit), so only the rest is prefilled.
    It is at most ``len(prompt) - 1``: the last prompt token is prefilled here, in the
    step that yields the first token (real vLLM 0.32 with NIXL counts all prompt tokens
    as external hits: one token of difference); after a preemption the sequence is
    recomputed like any other. ``hold_on_finish`` (prefill side): on a normal finish
    the blocks stay allocated until ``EngineCore.release`` (vLLM's delayed free while
    a decode engine pulls them); an abort frees them at once.
    """

    __slots__ = _SEQUENCE_ATTRS

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        arrival_s: float = 0.0,
        stop_reason: str = "length",
        planned_output_token_ids: list[int] | None = None,
        *,
        block_size: int = 16,
        private_from_block: int | None = None,
        num_transferred_tokens: int = 0,
        hold_on_finish: bool = False,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.arrival_s = arrival_s
        self.stop_reason = stop_reason
        self.planned_output_token_ids = planned_output_token_ids
        self.block_size = block_size
        self.private_from_block = private_from_block
        self.num_transferred_tokens = num_transferred_tokens
        self.hold_on_finish = hold_on_finish
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the cache
        self.free_segment_key = 0  # the block manager's handle on this sequence's freed blocks
        self.num_tokens = len(prompt_token_ids)  # prompt + output, kept for speed
        self.block_hashes: list[int] = []
        self._hash_new_blocks()

    def __deepcopy__(self, memo: dict[int, Any]) -> Sequence:
        """A deep copy with the same state (tests feed engines with copies). Written
        out because the compiled build cannot rebuild a native object without its
        constructor's arguments, as ``copy`` would; subclasses copy as ``Sequence``."""
        clone = Sequence(self.seq_id, [], self.max_tokens, block_size=self.block_size)
        for name in _SEQUENCE_ATTRS:
            setattr(clone, name, copy.deepcopy(getattr(self, name), memo))
        return clone

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}/{self.max_tokens}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The ids generated so far (built on demand: planned ids, then filler)."""
        return self._next_token_ids(0, self.num_output_tokens)

    @property
    def num_remaining_output_tokens(self) -> int:
        return self.max_tokens - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Prompt done and only the last generated token left to compute."""
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    def append_output_token(self) -> None:
        """Generate the next output token (the per-step hot path)."""
        self.num_output_tokens += 1
        self.num_tokens += 1
        if self.num_tokens % self.block_size == 0:
            self._hash_new_blocks()

    def append_output_tokens(self, num_tokens: int) -> None:
        """Generate the next ``num_tokens`` output tokens and hash newly full blocks."""
        self.num_output_tokens += num_tokens
        self.num_tokens += num_tokens
        if self.num_tokens >= (len(self.block_hashes) + 1) * self.block_size:
            self._hash_new_blocks()  # a block filled up (most fused runs fill none)

    def _next_token_ids(self, start: int, stop: int) -> list[int]:
        planned = self.planned_output_token_ids
        if planned is None:
            token_ids: list[int] = []
        else:
            token_ids = planned[start:stop]
            start += len(token_ids)
        if start < stop:
            period = _OUTPUT_ID_PERIOD
            offset = start % period
            if stop - start <= period:
                token_ids += _OUTPUT_ID_CYCLE_TWICE[offset : offset + stop - start]
            else:
                num_periods = (offset + stop - start) // period + 1
                token_ids += (_OUTPUT_ID_CYCLE * num_periods)[offset : offset + stop - start]
        return token_ids

    def _hash_new_blocks(self) -> None:
        size = self.block_size
        prompt = self.prompt_token_ids
        num_prompt = len(prompt)
        hashes = self.block_hashes
        prev = hashes[-1] if hashes else 0
        for begin in range(len(hashes) * size, self.num_tokens - size + 1, size):
            end = begin + size
            if end <= num_prompt:
                chunk = prompt[begin:end]
            elif begin >= num_prompt:
                chunk = self._next_token_ids(begin - num_prompt, end - num_prompt)
            else:
                chunk = prompt[begin:] + self._next_token_ids(0, end - num_prompt)
            prev = chain_block_hash(prev, chunk)
            hashes.append(prev)
