"""Cutting prompts at pre-token boundaries (issue 14 overhead): the ids of the pieces are
the ids of the whole, for GPT-2-, Llama-3- and Qwen-style byte-level BPE tokenizers;
Metaspace tokenizers are never cut; a shared head is encoded once; and the runtime
self-check turns the cache off on a tokenizer crafted to break the cut rule.

Each tokenizer is trained here with ``tokenizers`` on text with blank lines, indented
lines, punctuation before line ends and CRLF, so merges across those places exist.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import pytest

from kiloserve.gateway import exact_tokens, pretoken_cuts
from kiloserve.gateway.exact_tokens import ExactTokenizer
from kiloserve.gateway.pretoken_cuts import RULES, Cutter, unsupported_reason

tokenizers = pytest.importorskip("tokenizers")

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
WORDS = ["the", "of", "and", "to", "in", "is", "for", "tenant", "system", "prompt", "It's",
         "we'll", "DON'T", "x1", "2024", "123456", "3.14", "e.g.", "(see", "below)", "naïve",
         "café", "Zürich", "日本語", "—", "…", "😀", "def", "f(x):", "a_b", "#1", "$5",
         "100%", "<tag>", "[1]", "@home", "don't", "résumé", "e\u0301", "Ωmega"]  # fmt: skip
SEPARATORS = [" ", " ", " ", " ", " ", "  ", "\n", "\n\n", "\n\n\n", "\n\n\n\n\n\n", " \n",
              "\t", "\r\n", "\r\n\r\n", ". ", ".\n\n", ",\n", ":\n    ", "\n- ", "\n\t\t",
              " \n \n", "   \n\n  ", "\u00a0", "\u3000", "!\n", "?\r\n"]  # fmt: skip


def _paragraphs(rng: random.Random, num_words: int) -> str:
    parts = []
    for _ in range(num_words):
        parts += [rng.choice(WORDS), rng.choice(SEPARATORS)]
    return "".join(parts)


def _train(pre_tokenizer: Any, normalizer: Any = None, vocab_size: int = 1200) -> Any:
    """A byte-level BPE tokenizer trained on random paragraphs (no added tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(7)
    tok.train_from_iterator([_paragraphs(rng, 300) for _ in range(60)], trainer=trainer)
    return tok


def _split_byte_level(regex: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip


def _gpt2() -> Any:
    from tokenizers import pre_tokenizers

    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False))


def _llama3() -> Any:
    return _train(_split_byte_level(LLAMA3))


def _qwen2() -> Any:
    from tokenizers import normalizers

    return _train(_split_byte_level(QWEN2), normalizers.NFC())


class Counting:
    """A tokenizer that records the texts it encodes."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool) -> Any:
        self.texts.append(text)
        return self.real.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:  # the rest of the tokenizer, as it is
        return getattr(self.real, name)


@pytest.mark.parametrize(
    ("build", "rule"),
    [
        (_gpt2, "newline-before+space"),  # "\s+(?!\S)": a run's last newline stands alone
        (_llama3, "newline-after+space"),  # "\s*[\r\n]+": a blank line is one pre-token
        (_qwen2, "newline-after+space"),  # the same, with an NFC normaliser
    ],
    ids=["gpt2", "llama3", "qwen2"],
)
def test_piece_ids_are_the_whole_texts_ids(build: Any, rule: str) -> None:
    tok = build()
    assert len(tok.encode("\n\n", add_special_tokens=False).ids) == 1  # merges across lines
    rng = random.Random(11)
    texts = [_paragraphs(rng, rng.randrange(1, 400)) for _ in range(120)]
    texts += ["x\n\ny", "x.\n\ny", "a \n\n b", "a\r\n\r\nb", "1\n\n2", "\n\nx", "x\n\n", "é\n\nx"]
    for piece_chars in (1, 7, 64, 1024):
        exact = ExactTokenizer(tok, None, piece_chars=piece_chars, self_check_every=0)
        assert exact.caches_segments and exact.cut_rule == rule
        for text in texts:
            assert exact.encode(text, False) == tok.encode(text, add_special_tokens=False).ids
    assert exact.describe()["state"] == "on" and exact.describe()["cut_rule"] == rule


def test_the_wrong_newline_rule_would_change_the_ids() -> None:
    """Why the rule is chosen per tokenizer: each tokenizer breaks the other rule."""
    by_name = {r.name: r for r in RULES}
    for tok, wrong in ((_gpt2(), "newline-after"), (_llama3(), "newline-before")):
        cutter = Cutter([by_name[wrong]], 1)
        text = "tenant x\n\ny. z.\n\nw\n\n\n\nv"
        ids = [i for p in cutter.cut(text) for i in tok.encode(p, add_special_tokens=False).ids]
        pre = [
            p for piece in cutter.cut(text) for p, _ in tok.pre_tokenizer.pre_tokenize_str(piece)
        ]
        assert pre != [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert ids != tok.encode(text, add_special_tokens=False).ids


def test_metaspace_tokenizers_are_never_cut() -> None:
    from tokenizers import pre_tokenizers

    tok = _train(pre_tokenizers.Metaspace())
    counting = Counting(tok)
    exact = ExactTokenizer(counting, None, piece_chars=16)
    state = exact.describe()
    assert not exact.caches_segments and exact.cut_rule is None and state["state"] == "off"
    text = _paragraphs(random.Random(3), 2000)
    counting.texts.clear()
    assert exact.encode(text, True) == tok.encode(text, add_special_tokens=True).ids
    assert counting.texts == [text]  # encoded whole, in one call
    assert "Metaspace" in (unsupported_reason(tok.to_str()) or "")


def test_a_shared_head_is_encoded_once() -> None:
    tok = _llama3()
    rng = random.Random(5)
    head = _paragraphs(rng, 3000)
    head_tokens = len(tok.encode(head, add_special_tokens=False).ids)
    assert head_tokens >= 6000  # a 6k-token shared prefix
    counting = Counting(tok)
    exact = ExactTokenizer(counting, None, fast=False)  # the pieces by tokenizers: counted
    first, second = head + _paragraphs(rng, 600), head + _paragraphs(rng, 600)
    assert exact.encode(first, True) == tok.encode(first, add_special_tokens=True).ids
    counting.texts.clear()
    assert exact.encode(second, True) == tok.encode(second, add_special_tokens=True).ids
    encoded = sum(len(t) for t in counting.texts)
    # only the new tail and the piece that straddles the end of the shared head
    assert encoded <= len(second) - len(head) + 2 * exact_tokens.PIECE_CHARS
    assert len(counting.texts) >= 2


def _trap() -> Any:
    """Byte-level BPE over GPT-2's regex plus one rare alternative, ``@@ qzx``, that
    joins what the ``space`` rule cuts apart (and a merge that makes the ids differ):
    the probes never meet it, so the load-time check passes."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"@@": len(vocab), "@@Ġ": len(vocab) + 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("@", "@"), ("@@", "Ġ")]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("@@ qzx|" + GPT2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    return tok


def test_the_runtime_self_check_turns_the_cache_off(caplog: pytest.LogCaptureFixture) -> None:
    tok = _trap()
    text = "the tenant prompt\n@@ qzx and more words " * 40
    whole = tok.encode(text, add_special_tokens=False).ids
    unchecked = ExactTokenizer(tok, None, name="trap", piece_chars=8, self_check_every=0)
    assert unchecked.cut_rule == "newline-before+space"  # the probes did not see the trap
    assert unchecked.encode(text, False) != whole  # the rule is wrong for this tokenizer
    counting = Counting(tok)
    exact = ExactTokenizer(counting, None, name="trap", piece_chars=8, self_check_every=3,
                           fast=False)  # fmt: skip
    fine = "the tenant prompt\nand more words " * 40  # no trap: the checks pass
    for _ in range(3):
        assert exact.encode(fine, False) == tok.encode(fine, add_special_tokens=False).ids
    assert exact.num_self_checks == 1 and exact.caches_segments
    with caplog.at_level(logging.WARNING, logger="kiloserve.gateway.exact_tokens"):
        assert exact.encode(text, False) != whole  # not sampled: the pieces' (wrong) ids
        assert exact.encode(text, False) != whole
        assert exact.encode(text, False) == whole  # sampled: caught, the whole's ids
    assert exact.num_self_checks == 2 and not exact.caches_segments
    state = exact.describe()
    assert state["state"] == "off" and "self-check mismatch" in state["disabled"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "model trap" in caplog.records[0].getMessage()
    assert "qzx" not in caplog.records[0].getMessage()  # never the prompt
    counting.texts.clear()
    assert exact.encode(text, False) == whole and counting.texts == [text]  # whole from now on


def test_cuts_depend_only_on_the_text_before_them() -> None:
    rng = random.Random(9)
    cutter = Cutter(RULES[:1] + RULES[2:], 64)
    for _ in range(50):
        head = _paragraphs(rng, 400)
        a, b = cutter.cut(head + _paragraphs(rng, 50)), cutter.cut(head + _paragraphs(rng, 50))
        assert "".join(a).startswith(head) and all(len(p) >= 64 for p in a[:-1])
        shared = [p for p, q in zip(a, b, strict=False) if p == q]
        assert len("".join(shared)) >= len(head) - 200  # all but the piece at the end


def _split_spec(regex: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    steps = [split, {"type": "ByteLevel", "use_regex": False}]
    return {"pre_tokenizer": {"type": "Sequence", "pretokenizers": steps}}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"normalizer": {"type": "NFKC"}}, "NFKC normalizer"),
        ({"model": {"type": "WordPiece"}}, "WordPiece model"),
        ({"model": {"type": "BPE", "dropout": 0.1}}, "dropout"),
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}, "prefix space"),
        ({"pre_tokenizer": {"type": "ByteLevel", "use_regex": False}}, "no regex split"),
        ({"pre_tokenizer": None}, "no pre-tokenizer"),
        (_split_spec(r"(?<=\w)\s"), "looks behind"),
        (_split_spec(r"^\s+|\S+"), "anchors"),
        (_split_spec(r"\s+$|\S+"), "anchors"),
    ],
)
def test_unsupported_shapes(change: dict[str, Any], reason: str) -> None:
    base = {"normalizer": None, "model": {"type": "BPE", "dropout": None},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}}  # fmt: skip
    assert reason in (unsupported_reason(json.dumps(base | change)) or "")
    assert unsupported_reason(json.dumps(base)) is None
    ok = {"normalizer": {"type": "NFC"}, "model": {"type": "BPE"}} | _split_spec(LLAMA3)
    assert unsupported_reason(json.dumps(ok)) is None
    assert pretoken_cuts.unsupported_reason(json.dumps(_split_spec(r"[^$\s]+|\s") | {
        "model": {"type": "BPE"}})) is None  # fmt: skip
