"""The fast encoder (``tiktoken`` built from ``tokenizer.json``, issue 14 overhead): the
same ids as ``tokenizers`` for GPT-2-, Llama-3- and Qwen-style byte-level BPE (merged
ids in merge order or not), refused for shapes it does not cover, and turned off for
good by the runtime self-check on the first difference."""

from __future__ import annotations

import json
import logging
import random
import sys
from typing import Any

import pytest
from test_pretoken_cuts import LLAMA3, _gpt2, _llama3, _paragraphs, _qwen2, _split_spec

from kiloserve.gateway import fast_bpe
from kiloserve.gateway.exact_tokens import ExactTokenizer
from kiloserve.gateway.fast_bpe import fast_encoder_for, spec_reason

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")


_SPLIT = _split_spec(LLAMA3)["pre_tokenizer"]["pretokenizers"][0]
_BYTES = {"type": "ByteLevel", "use_regex": False}
TWO_SPLITS = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [_SPLIT, _SPLIT, _BYTES]}}


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [_paragraphs(rng, rng.randrange(1, 400)) for _ in range(60)]


@pytest.mark.parametrize("build", [_gpt2, _llama3, _qwen2], ids=["gpt2", "llama3", "qwen2"])
def test_the_fast_encoder_gives_the_tokenizers_own_ids(build: Any) -> None:
    tok = build()
    fast, why = fast_encoder_for(tok)
    assert fast is not None, why
    for text in _texts(11):
        assert fast.encode(text) == tok.encode(text, add_special_tokens=False).ids
    exact = ExactTokenizer(tok, None, name="m")
    assert exact.encoder == "tiktoken" and exact.describe()["encoder"] == "tiktoken"
    for text in _texts(12):
        for add in (False, True):
            assert exact.encode(text, add) == tok.encode(text, add_special_tokens=add).ids


def _with_spec(tok: Any, change: Any) -> Any:
    spec = json.loads(tok.to_str())
    change(spec)
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def test_merged_ids_out_of_merge_order_are_mapped() -> None:
    tok = _gpt2()

    def swap(spec: dict[str, Any]) -> None:  # the ids of the first and last merges' tokens
        model = spec["model"]
        first, last = (m if isinstance(m, list) else m.split(" ") for m in
                       (model["merges"][0], model["merges"][-1]))  # fmt: skip
        a, b = "".join(first), "".join(last)
        model["vocab"][a], model["vocab"][b] = model["vocab"][b], model["vocab"][a]

    swapped = _with_spec(tok, swap)
    built = fast_bpe._ranks(json.loads(swapped.to_str())["model"])
    assert not isinstance(built, str) and built[1] is not None  # a rank -> id table
    fast, why = fast_encoder_for(swapped)
    assert fast is not None, why
    for text in _texts(13):
        assert fast.encode(text) == swapped.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"normalizer": {"type": "NFKC"}}, "NFKC normalizer"),
        ({"model": {"type": "WordPiece"}}, "WordPiece model"),
        ({"model": {"type": "BPE", "dropout": 0.1}}, "dropout"),
        ({"model": {"type": "BPE", "byte_fallback": True}}, "byte fallback"),
        ({"model": {"type": "BPE", "continuing_subword_prefix": "##"}}, "affixes"),
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}, "one regex"),
        ({"pre_tokenizer": {"type": "ByteLevel", "use_regex": False}}, "one regex"),
        ({"pre_tokenizer": {"type": "Metaspace"}}, "one regex"),
        ({"pre_tokenizer": None}, "one regex"),
        (TWO_SPLITS, "one regex"),
    ],
)
def test_shapes_without_a_fast_encoder(change: dict[str, Any], reason: str) -> None:
    base = {"normalizer": None, "model": {"type": "BPE", "dropout": None},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}}  # fmt: skip
    assert spec_reason(base) is None
    assert reason in (spec_reason(base | change) or "")
    assert spec_reason({"normalizer": {"type": "NFC"}, "model": {"type": "BPE"}}
                       | _split_spec(LLAMA3)) is None  # fmt: skip


def test_two_merges_making_one_token_are_refused() -> None:
    """``tokenizers`` applies only the merges it lists; ``tiktoken`` would join any two
    parts whose bytes make a known token: with two ways to one token they can differ."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in ("ab", "bc", "abc"):
        vocab[token] = len(vocab)
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert fast_encoder_for(tok) == (None, "two merges make one token")
    exact = ExactTokenizer(tok, None)
    assert exact.encoder == "tokenizers"
    assert exact.describe()["no_fast_encoder"] == "two merges make one token"


def test_without_tiktoken_tokenizers_encodes(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _llama3()
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    assert fast_encoder_for(tok) == (None, "tiktoken is not installed")
    exact = ExactTokenizer(tok, None)
    assert exact.encoder == "tokenizers" and exact.caches_segments
    assert exact.describe()["no_fast_encoder"] == "tiktoken is not installed"
    text = _paragraphs(random.Random(4), 900)
    assert exact.encode(text, True) == tok.encode(text, add_special_tokens=True).ids


def test_the_runtime_self_check_turns_the_fast_encoder_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = _llama3()
    exact = ExactTokenizer(tok, None, name="m", self_check_every=2)
    assert exact.encoder == "tiktoken"
    fast = exact._fast
    assert fast is not None
    right = fast._encode_ranks

    def wrong(text: str) -> list[int]:  # a difference the probes never met
        ids = right(text)
        return ids[:-1] if "zqx" in text else ids

    fast._encode_ranks = wrong
    text = _paragraphs(random.Random(6), 800) + " zqx"
    whole = tok.encode(text, add_special_tokens=False).ids
    with caplog.at_level(logging.WARNING, logger="kiloserve.gateway.exact_tokens"):
        assert exact.encode(text, False) != whole  # not sampled: the fast (wrong) ids
        assert exact.encode(text, False) == whole  # sampled: caught, the whole's ids
    assert exact.encoder == "tokenizers" and exact.num_self_checks == 1
    state = exact.describe()
    assert state["encoder"] == "tokenizers" and "self-check" in state["no_fast_encoder"]
    assert exact.caches_segments and state["pieces_cached"] == 0  # its pieces forgotten
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "model m" in caplog.records[0].getMessage()
    assert "zqx" not in caplog.records[0].getMessage()  # never the prompt
    for _ in range(4):
        assert exact.encode(text, False) == whole
    # the encoder is built once per tokenizer.json; each model's tokenizer has its own
    # wrapper, so another one is untouched (fast, and right)
    other = ExactTokenizer(tok, None, name="n", self_check_every=2)
    assert other.encoder == "tiktoken" and other._fast is not fast
    assert other.encode(text, False) == whole and other.encoder == "tiktoken"
