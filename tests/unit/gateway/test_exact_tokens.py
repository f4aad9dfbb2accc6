"""The exact tokenizer's cache of the text between added tokens (issue 14 overhead)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import tokenizers
from test_chat_template import _model_dir

from kiloserve.gateway import exact_tokens
from kiloserve.gateway.chat_template import load_exact_tokenizer

WORDS = ["the", "of", "and", "to", "in", "is", "for", "tenant", "prompt", "system", "tool"]
WORDS += ["agent", "cache", "block\n", "", ",.!", "  "]


def _text(rng: random.Random, specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randrange(1, 8)):
        parts.append(rng.choice(specials))
        parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 120))))
    return "".join(parts)


def test_piece_cache_gives_the_tokenizers_own_ids(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    exact = load_exact_tokenizer(str(folder / "tokenizer.json"), None)
    assert exact.caches_segments
    whole = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    specials = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", ""]
    rng = random.Random(5)
    for _ in range(200):
        text = _text(rng, specials)
        for add in (False, True):
            assert exact.encode(text, add) == whole.encode(text, add_special_tokens=add).ids
    # a repeated long piece comes from the cache: same ids, no second encode (the
    # pieces encoded by tokenizers, to count the calls)
    exact = exact_tokens.ExactTokenizer(exact._tokenizer, exact.template, fast=False)
    system = "<|im_start|>system\n" + "tenant prompt " * 100 + "<|im_end|>"
    first = exact.encode(system + "<|im_start|>user\nhi<|im_end|>", False)
    calls: list[str] = []
    real = exact._tokenizer

    class Counting:
        def encode(self, text: str, add_special_tokens: bool) -> Any:
            calls.append(text)
            return real.encode(text, add_special_tokens=add_special_tokens)

    exact._tokenizer = Counting()
    again = exact.encode(system + "<|im_start|>user\nhi<|im_end|>", False)
    assert again == first and all(len(c) < exact_tokens.MIN_CACHED_CHARS for c in calls)


def test_no_piece_cache_when_added_tokens_match_with_options(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken("<tool>", lstrip=True, special=True)])
    tok.save(str(folder / "tokenizer.json"))
    exact = load_exact_tokenizer(str(folder / "tokenizer.json"), None)
    assert not exact.caches_segments
    text = "a  <tool> b" * 40
    assert exact.encode(text, False) == tok.encode(text, add_special_tokens=False).ids
