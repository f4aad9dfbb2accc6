"""Deterministic prompt text of an exact token length.

Prompts are made of *blocks* of ``BLOCK_TOKENS`` (512) words drawn from
``kiloserve.tokens.FILLER_WORDS`` (each word is at most four letters, so under
``kiloserve.tokens.tokenize`` every word is exactly one token and N words joined by
single spaces are N tokens). A block's words depend only on its key, so two prompts
that list the same keys first share a byte-identical prefix, and the engine twin's
prefix cache (16-token block hashes over ``tokenize`` ids) really hits.

Keys are tuples of non-negative ints: ``(namespace, ...)``. Mooncake ``hash_ids`` map
to ``(NS_MOONCAKE, hash_id)``; unique request text uses ``(NS_UNIQUE, seed, index, k)``.
A block is 32 chunks of 16 words; the chunk ids are a hash (blake2b) of the key and
index a fixed table of 65,536 random 16-word strings, so rendering a block is a hash
and a join (a 100k-token prompt takes about a millisecond). Distinct blocks share a
leading 16-word chunk with probability 1/65,536: harmless for prefix caching.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kiloserve.tokens import FILLER_WORDS

__all__ = [
    "BLOCK_TOKENS",
    "NS_ANSWER",
    "NS_GROUP",
    "NS_MOONCAKE",
    "NS_UNIQUE",
    "BlockKey",
    "PromptBuilder",
    "Segment",
    "split_tokens",
]

BLOCK_TOKENS = 512
CHUNK_TOKENS = 16
NUM_CHUNKS = 65_536  # chunk ids are 16-bit
CHUNK_TABLE_SEED = 20_261_129
NS_UNIQUE = 1
NS_GROUP = 2
NS_MOONCAKE = 3
NS_ANSWER = 4

BlockKey = tuple[int, ...]
# (key, num_tokens): the first num_tokens words of block ``key`` (num_tokens <= 512)
Segment = tuple[BlockKey, int]


class PromptBuilder:
    """Renders lists of block segments to text; caches full blocks (LRU)."""

    def __init__(self, max_num_cached_blocks: int = 4096) -> None:
        self._cache: OrderedDict[BlockKey, str] = OrderedDict()
        self._max_num_cached_blocks = max_num_cached_blocks
        self._chunks = _chunk_table()

    def block_text(self, key: BlockKey, num_tokens: int = BLOCK_TOKENS) -> str:
        """The first ``num_tokens`` words of block ``key``."""
        if num_tokens == BLOCK_TOKENS:
            return self._full_block(key)
        return self._words(key, num_tokens)

    def render(self, segments: Sequence[Segment]) -> str:
        """Join the segments' text with single spaces (token counts add up)."""
        return " ".join(self.block_text(key, n) for key, n in segments if n > 0)

    def _full_block(self, key: BlockKey) -> str:
        text = self._cache.get(key)
        if text is not None:
            self._cache.move_to_end(key)
            return text
        text = self._words(key, BLOCK_TOKENS)
        self._cache[key] = text
        if len(self._cache) > self._max_num_cached_blocks:
            self._cache.popitem(last=False)
        return text

    def _words(self, key: BlockKey, num_tokens: int) -> str:
        # 32 chunk ids from a hash of the key only: stable across runs and processes.
        digest = hashlib.blake2b(repr(key).encode(), digest_size=64).digest()
        ids = np.frombuffer(digest, dtype="<u2").tolist()
        num_full, rest = divmod(num_tokens, CHUNK_TOKENS)
        parts = [self._chunks[i] for i in ids[:num_full]]
        if rest:
            parts.append(" ".join(self._chunks[ids[num_full]].split(" ")[:rest]))
        return " ".join(parts)


@functools.cache
def _chunk_table() -> tuple[str, ...]:
    """NUM_CHUNKS fixed 16-word strings (a pure constant, built once on first use)."""
    rng = np.random.default_rng(CHUNK_TABLE_SEED)
    idx = rng.integers(0, len(FILLER_WORDS), size=(NUM_CHUNKS, CHUNK_TOKENS))
    words = np.array(FILLER_WORDS, dtype=object)[idx]
    return tuple(" ".join(row) for row in words.tolist())


def split_tokens(key_prefix: BlockKey, num_tokens: int) -> list[Segment]:
    """Segments for ``num_tokens`` of fresh text under keys ``key_prefix + (k,)``."""
    out: list[Segment] = []
    k = 0
    while num_tokens > 0:
        n = min(BLOCK_TOKENS, num_tokens)
        out.append(((*key_prefix, k), n))
        num_tokens -= n
        k += 1
    return out
