"""The approximate profile's one-pass path (issue 14 overhead) gives the counts and the
prefix hashes of the two-pass reference, the code before it: ``count_tokens`` over the
whole prompt, then ``tokenize`` over the prefix the cap can reach."""

from __future__ import annotations

import random

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.profile import MAX_PIECE_CHARS, Profiler, approximate_chat_text
from kiloserve.tokens import _PIECE, cache_seed, count_tokens, prefix_block_hashes, tokenize

PIECES = ["the", "of", "tenant", "abcdefghij", "x", "日本語", "😀", "e\u0301", ",", "...",
          " ", "  ", "\n", "\n\n", "\t", "\r\n", " " * 40, "\u00a0", "\u3000", "-"]  # fmt: skip


def _reference(text: str, cap: int, block_size: int, seed: int) -> tuple[int, tuple[int, ...]]:
    """The profile's (count, hashes) as computed before the one-pass path."""
    num_tokens = len(_PIECE.findall(text))
    if num_tokens < block_size:
        return num_tokens, ()
    max_chars = cap * MAX_PIECE_CHARS
    ids = tokenize(text) if len(text) <= max_chars else tokenize(text[:max_chars])[:-1]
    return num_tokens, tuple(prefix_block_hashes(ids[:cap], block_size, seed))


@pytest.mark.parametrize("cap", [16, 100, 2048, 8192])
def test_one_pass_counts_and_hashes_equal_the_reference(cap: int) -> None:
    rng = random.Random(cap)
    prof = Profiler(parse_gateway_config({"max_prefix_tokens": cap}))
    salted = cache_seed(cache_salt="s")
    for n in range(150):
        size = rng.choice([0, 3, 20, 300, 3000, 12_000])
        text = "".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(size))
        assert count_tokens(text) == len(_PIECE.findall(text)) == len(tokenize(text))
        body = {"model": "m", "prompt": text}
        seed = 0
        if n % 3 == 0:
            body["cache_salt"], seed = "s", salted
        info = prof.profile("r", body, {})
        assert (info.input_tokens, info.prefix_hashes) == _reference(text, cap, 16, seed)
        chat = {"model": "m", "messages": [{"role": "user", "content": text}]}
        info = prof.profile("r", chat, {})
        rendered = approximate_chat_text(chat)
        assert (info.input_tokens, info.prefix_hashes) == _reference(rendered, cap, 16, 0)
