"""Prompt text: exact token counts, determinism, shared prefixes at block granularity."""

from __future__ import annotations

import time

import pytest

from kiloserve.tokens import block_hashes, count_tokens, tokenize
from kiloserve.workload.prompts import BLOCK_TOKENS, NS_MOONCAKE, PromptBuilder, split_tokens


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 511, 512, 513, 1500])
def test_prompt_has_exact_token_count(num_tokens: int) -> None:
    text = PromptBuilder().render(split_tokens((1, 0, 7), num_tokens))
    assert count_tokens(text) == num_tokens
    assert len(tokenize(text)) == num_tokens


def test_same_key_same_text_across_builders() -> None:
    a = PromptBuilder().render(split_tokens((1, 5, 9), 700))
    b = PromptBuilder(max_num_cached_blocks=1).render(split_tokens((1, 5, 9), 700))
    assert a == b
    assert a != PromptBuilder().render(split_tokens((1, 5, 10), 700))


def test_partial_block_is_prefix_of_full_block() -> None:
    builder = PromptBuilder()
    full = builder.block_text((NS_MOONCAKE, 42))
    part = builder.block_text((NS_MOONCAKE, 42), 100)
    assert full.startswith(part + " ")
    assert count_tokens(full) == BLOCK_TOKENS


def test_shared_blocks_give_identical_engine_prefix_hashes() -> None:
    builder = PromptBuilder()
    shared = [((NS_MOONCAKE, 1), 512), ((NS_MOONCAKE, 2), 512)]
    a = builder.render([*shared, ((NS_MOONCAKE, 3), 300)])
    b = builder.render([*shared, ((NS_MOONCAKE, 4), 300)])
    ha, hb = block_hashes(tokenize(a)), block_hashes(tokenize(b))
    assert ha[:64] == hb[:64]  # 1024 shared tokens = 64 blocks of 16
    assert ha[64] != hb[64]


def test_large_prompt_is_fast() -> None:
    builder = PromptBuilder()
    builder.render(split_tokens((1, 0, 0), 16))  # build the chunk table once
    t0 = time.perf_counter()
    text = builder.render(split_tokens((1, 0, 1), 100_000))
    assert time.perf_counter() - t0 < 0.5
    assert count_tokens(text) == 100_000
