"""A faster encoder for byte-level BPE tokenizers: ``tiktoken``, built from the model's
own ``tokenizer.json``, used only where it gives the same ids as ``tokenizers``.

Issue 14's per-request target (tokenising and index lookup <= 1 ms of gateway CPU at
8k-token prompts) is missed by the text a request brings of its own: the piece cache
(``exact_tokens``) makes a repeated head free, but ``tokenizers`` encodes new text at
about 1 us per token on the development box, so a 2,048-token tail costs ~2 ms.
``tiktoken`` runs the same algorithm (a regex split into pre-tokens, then byte-pair
merges in rank order inside each) ~8x faster on a whole 8k-token prompt
(benchmarks/prefix_overhead.py, its "encode only" rows).

The two agree when:

* the ``tokenizer.json`` is byte-level BPE: no normaliser or NFC (applied here, as the
  tokenizer would), a ``ByteLevel`` pre-tokenizer without a prefix space, with its
  GPT-2 regex on, or one isolating ``Split`` regex before a ``ByteLevel`` with its regex
  off (Llama-3, Qwen); BPE without dropout, byte fallback or sub-word affixes; every
  one of the 256 byte symbols in the vocabulary;
* the merges rank the tokens they make: each merge makes a token no other merge
  makes (``tiktoken`` ranks a pair by the token it makes, ``tokenizers`` by the merge's
  position; with one merge per token these are the same order);
* the regex means the same to both regex engines (Oniguruma for ``tokenizers``,
  fancy-regex for ``tiktoken``): not assumed, checked.

``fast_encoder_for`` checks the shape, builds the encoder (ranks are the token ids
when the merges made them in id order, as trained vocabularies do; else a table maps
ranks to ids) and compares it with ``tokenizers`` on a battery of probe texts (the
cut rules' probes, and runs of random vocabulary tokens, which exercise the merges
of every length); any difference and it is not used. It encodes text without added
tokens only: ``ExactTokenizer`` splits at those first, and uses it for the pieces in
between. At run time the self-check (one request in ``self_check_every``, against
``tokenizers``' encode of the whole text) turns it off for the model for good on a
difference.
"""

from __future__ import annotations

import itertools
import json
import random
import unicodedata
from collections.abc import Callable
from typing import Any

from kiloserve.gateway.pretoken_cuts import bpe_reason, per_tokenizer_json, probe_texts

__all__ = ["GPT2_PATTERN", "FastEncoder", "fast_encoder_for", "spec_reason"]

# the regex of ``tokenizers``' ByteLevel pre-tokenizer (``use_regex: true``), GPT-2's
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_NUM_RANDOM_PROBES = 160  # texts of random vocabulary tokens checked at load
_TOKENS_PER_PROBE = 24


def _byte_symbols() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


_SYMBOLS = _byte_symbols()


class FastEncoder:
    """``encode(text)``: the ids of a text that holds no added token, as the model's
    ``tokenizers`` gives them without special tokens."""

    def __init__(self, encode_ranks: Callable[[str], list[int]], rank_to_id: list[int] | None,
                 nfc: bool) -> None:  # fmt: skip
        self._encode_ranks = encode_ranks
        self._rank_to_id = rank_to_id
        self._nfc = nfc

    def copy(self) -> FastEncoder:
        """The same encoder in a wrapper of its own (each model's tokenizer gets one)."""
        return FastEncoder(self._encode_ranks, self._rank_to_id, self._nfc)

    def encode(self, text: str) -> list[int]:
        if self._nfc and not text.isascii():
            text = unicodedata.normalize("NFC", text)
        ranks = self._encode_ranks(text)
        table = self._rank_to_id
        return ranks if table is None else [table[r] for r in ranks]


def _pattern(pre: Any) -> str | None:
    """The one regex that splits a text into pre-tokens, or None."""
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel":
        ok = pre.get("use_regex", True) and not pre.get("add_prefix_space")
        return GPT2_PATTERN if ok else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return None
    split, byte_level = steps
    if not (isinstance(split, dict) and isinstance(byte_level, dict)):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
            or split.get("invert") or not isinstance(regex, str)):  # fmt: skip
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space"):
        return None
    return regex if not byte_level.get("use_regex", True) else None


def spec_reason(spec: dict[str, Any]) -> str | None:
    """Why this ``tokenizer.json`` (parsed) has no fast encoder (None: it may)."""
    reason = bpe_reason(spec)
    if reason is not None:
        return reason
    model = spec["model"]
    if model.get("byte_fallback"):
        return "BPE byte fallback (not byte-level)"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "sub-word affixes"
    if _pattern(spec.get("pre_tokenizer")) is None:
        return "not a byte-level pre-tokenizer with one regex"
    return None


def _to_bytes(symbols: str) -> bytes | None:
    try:
        return bytes(_SYMBOLS[ch] for ch in symbols)
    except KeyError:
        return None


def _ranks(model: dict[str, Any]) -> tuple[dict[bytes, int], list[int] | None] | str:
    """``tiktoken``'s ranks (bytes -> rank) and the rank -> id table (None: ranks are
    ids), or why there are none."""
    vocab: dict[str, int] = model.get("vocab") or {}
    byte_ids: dict[bytes, int] = {}
    for symbol, b in _SYMBOLS.items():
        if symbol not in vocab:
            return "a byte symbol missing from the vocabulary"
        byte_ids[bytes([b])] = vocab[symbol]
    made: list[tuple[bytes, int]] = []
    seen: set[bytes] = set(byte_ids)
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        token_id = vocab.get(left + right)
        token = _to_bytes(left + right)
        if token_id is None or token is None:
            return "a merge that makes no vocabulary token"
        if token in seen:
            return "two merges make one token"
        seen.add(token)
        made.append((token, token_id))
    # tiktoken compares the ranks of tokens of two or more bytes only (a pair's), so
    # the ids serve as ranks when the merges made their tokens in id order
    if all(a[1] < b[1] for a, b in itertools.pairwise(made)):
        ranks = dict(byte_ids)
        ranks.update(made)
        if len(set(ranks.values())) == len(ranks):
            return ranks, None
    ordered = sorted(byte_ids.items(), key=lambda item: item[1]) + made
    return {token: rank for rank, (token, _) in enumerate(ordered)}, [i for _, i in ordered]


def _random_probes(vocab: dict[str, int], seed: int) -> list[str]:
    """Texts made of random vocabulary tokens, run together and spaced."""
    rng = random.Random(seed)
    texts: list[str] = []
    tokens = [t for t in (_to_bytes(s) for s in vocab) if t is not None]
    if not tokens:
        return texts
    for i in range(_NUM_RANDOM_PROBES):
        picked = rng.choices(tokens, k=_TOKENS_PER_PROBE)
        text = (b"" if i % 2 else b" ").join(picked).decode("utf-8", errors="ignore")
        texts.append(text)
    return texts


_BUILT: dict[str, tuple[FastEncoder | None, str]] = {}  # tokenizer.json digest -> result
_MAX_BUILT = 8


def fast_encoder_for(tokenizer: Any) -> tuple[FastEncoder | None, str]:
    """The fast encoder for a ``tokenizers.Tokenizer``, or None and why not. Building
    and checking one takes up to a second for a large vocabulary, so the result is kept
    per ``tokenizer.json`` content (a pure function of it: reloads and several models
    with one tokenizer pay once)."""
    try:
        import tiktoken  # noqa: F401  (only whether it is there, here)
    except ImportError:
        return None, "tiktoken is not installed"
    built = per_tokenizer_json(
        _BUILT, _MAX_BUILT, tokenizer, lambda text: _build(tokenizer, json.loads(text))
    )
    if isinstance(built, str):
        return None, built
    fast, why = built
    return (fast.copy() if fast is not None else None), why


def _build(tokenizer: Any, spec: dict[str, Any]) -> tuple[FastEncoder | None, str]:
    import tiktoken

    reason = spec_reason(spec)
    if reason is not None:
        return None, reason
    pattern = _pattern(spec.get("pre_tokenizer"))
    built = _ranks(spec["model"])
    if isinstance(built, str):
        return None, built
    ranks, rank_to_id = built
    try:
        encoding = tiktoken.Encoding(
            "kiloserve-fast-bpe", pat_str=pattern or GPT2_PATTERN, mergeable_ranks=ranks,
            special_tokens={},
        )  # fmt: skip
    except Exception as exc:  # a regex fancy-regex cannot compile, ...
        return None, f"tiktoken refused it ({type(exc).__name__})"
    normalizer = spec.get("normalizer")
    fast = FastEncoder(encoding.encode_ordinary, rank_to_id, nfc=normalizer is not None)
    added = [t.get("content", "") for t in spec.get("added_tokens") or [] if t.get("content")]
    for text in (*probe_texts(), *_random_probes(spec["model"].get("vocab") or {}, 14)):
        if any(a in text for a in added):
            continue  # the caller splits at added tokens before encoding
        if fast.encode(text) != tokenizer.encode(text, add_special_tokens=False).ids:
            return None, "differs from tokenizers on a probe text"
    return fast, ""
