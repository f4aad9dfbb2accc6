"""The deterministic tokenizer approximation shared by twin, gateway and workloads.

Real tokenizers need vocabulary files; kiloserve uses a documented approximation when
no ``tokenizer.json`` is configured:

* text is split into pieces: every run of non-space characters is cut into chunks of
  at most ``CHARS_PER_PIECE`` (4) characters, and a single leading space (if any) joins
  the first chunk of the run; other whitespace runs are pieces of their own;
* every piece is one token; its id is a stable hash of the piece modulo the vocabulary.

English text averages ~4.2 characters per BPE token, so counts land within ~10-20%
of Llama/Qwen tokenizers on prose. Workload generators build prompts from words of at
most four letters joined by single spaces, so N words are exactly N tokens here.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence

__all__ = [
    "CHARS_PER_PIECE",
    "FILLER_WORDS",
    "MAX_TOKEN_ID",
    "block_hashes",
    "cache_seed",
    "chunk_bounds",
    "count_tokens",
    "estimate_tokens",
    "filler_text",
    "prefix_block_hashes",
    "tokenize",
]

CHARS_PER_PIECE = 4
DEFAULT_VOCAB = 128_000
MAX_TOKEN_ID = 2**32 - 1  # block hashes pack each id in 4 bytes
_PIECE = re.compile(r" ?[^\s]{1,4}|[^\S]+|[^\s]{1,4}")
_WORD_END = re.compile(r"\S\s")  # a non-space character followed by whitespace

# Short words (<= 4 chars) used for deterministic prompt and output text.
FILLER_WORDS: tuple[str, ...] = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "it",
    "was",
    "by",
    "at",
    "from",
    "be",
    "this",
    "are",
    "or",
    "an",
    "has",
    "not",
    "but",
    "all",
    "can",
    "one",
    "more",
    "also",
    "new",
    "time",
    "data",
    "node",
    "card",
    "fast",
    "load",
    "team",
    "cell",
    "rack",
    "path",
    "plan",
    "gate",
    "test",
    "span",
    "tail",
    "edge",
    "core",
    "page",
    "file",
    "line",
    "word",
    "task",
    "work",
    "run",
    "job",
)


def _pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


def tokenize(text: str, vocab_size: int = DEFAULT_VOCAB) -> list[int]:
    """Token ids of ``text`` under the approximation (stable across runs)."""
    return [zlib.crc32(p.encode()) % vocab_size for p in _pieces(text)]


def count_tokens(text: str) -> int:
    """Number of tokens ``tokenize`` would return, without hashing (``subn`` counts
    the matches without building a string per piece: ~20% cheaper than ``findall``)."""
    return _PIECE.subn("", text)[1]


def chunk_bounds(text: str, size: int) -> list[tuple[int, int]]:
    """``(start, end)`` slices of ``text``, each about ``size`` characters or more, cut
    only where a whitespace run starts after a word: no piece spans a cut, so
    ``count_tokens`` / ``tokenize`` of the slices add up to those of the whole text
    (lets a caller process a long prompt in steps, e.g. yielding to an event loop)."""
    bounds: list[tuple[int, int]] = []
    start = 0
    n = len(text)
    while start < n:
        found = _WORD_END.search(text, min(start + max(size, 1), n) - 1)
        end = n if found is None else found.start() + 1
        bounds.append((start, end))
        start = end
    return bounds


def estimate_tokens(num_chars: int) -> int:
    """Calibrated estimate from a character count (used when text is not at hand)."""
    return max(1, round(num_chars / 4.2))


def filler_text(num_tokens: int, seed: int = 0) -> str:
    """Deterministic text of exactly ``num_tokens`` tokens under ``tokenize``."""
    n = len(FILLER_WORDS)
    words = [FILLER_WORDS[(seed * 7919 + i * 31 + (i * i) % 17) % n] for i in range(num_tokens)]
    return " ".join(words)


def block_hashes(token_ids: Sequence[int], block_size: int = 16) -> list[int]:
    """Chained hashes of the full ``block_size`` blocks of ``token_ids``.

    Block i's hash covers blocks 0..i, so equal hashes mean equal prefixes (as in
    vLLM's prefix cache). Stable across processes (no Python ``hash``). Ids must be
    ints in 0..``MAX_TOKEN_ID`` (``OverflowError`` otherwise: callers that take ids from
    clients check them first, as the gateway's profiler does).
    """
    out: list[int] = []
    prev = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = token_ids[start : start + block_size]
        data = prev.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in chunk)
        prev = zlib.crc32(data) | (zlib.adler32(data) << 32)
        out.append(prev)
    return out


def cache_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The root of a prompt's ``prefix_block_hashes`` chain: 0 for the base model
    without a cache salt, else a stable 63-bit digest of both (as vLLM keys blocks by
    LoRA and salt too: the same tokens under another adapter or salt never match)."""
    if not lora_name and not cache_salt:
        return 0
    data = f"{lora_name or ''}\x00{cache_salt or ''}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


def prefix_block_hashes(token_ids: Sequence[int], block_size: int = 16, seed: int = 0) -> list[int]:
    """The gateway's chained block hashes: ``hash((prev, block_tuple))`` from ``seed``.

    Used for routing (the approximate index, and the exact index built from the
    engines' KV events, whose token ids are hashed the same way). Python's tuple hash
    of ints is not salted (``PYTHONHASHSEED`` salts only str and bytes), so the values
    are stable across processes of one Python version; ~10x cheaper than
    ``block_hashes``. Equal to the simulator's sequence hashes (seed 0).
    """
    out: list[int] = []
    prev = seed
    end = len(token_ids) - len(token_ids) % block_size
    for block in zip(*[iter(token_ids[:end])] * block_size, strict=False):
        prev = hash((prev, block))
        out.append(prev)
    return out
