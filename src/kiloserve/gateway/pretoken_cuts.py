"""Where a byte-level BPE tokenizer's text can be cut without changing its token ids.

A byte-level BPE ``tokenizer.json`` (GPT-2, Llama-3, Qwen style) splits a text into
pre-tokens with a regex (its ``Split`` pre-tokenizer, or ``ByteLevel``'s own GPT-2
regex) and runs BPE on each pre-token alone: merges never cross a pre-token boundary.
So the ids of a text are the ids of its pieces, encoded one by one, IF every cut is a
pre-token boundary of the whole text, and the pieces are pre-tokenised as they are
inside it. The regexes only look forward (no look-behind, no anchors), so a piece
starting at a boundary is split as it is in the whole; what differs between them is
the end of a piece: ``\\s+(?!\\S)`` (GPT-2) keeps the last space of a run apart from
the next word, and sees the end of a piece as "no word follows".

Three cut rules (``RULES``); each cuts only next to a character that no pre-token
joins across under the regexes these tokenizers use:

* ``newline-before``: before the newline that ends a whitespace run followed by a
  non-space character ("x\\n" | "\\ny"); GPT-2's regex gives "x","\\n","\\n","y" for
  "x\\n\\ny", so the run's last newline is a pre-token of its own;
* ``newline-after``: after that run ("x\\n\\n" | "y"); Llama-3 and Qwen join a blank
  line ("\\n\\n", "\\s*[\\r\\n]+") and punctuation with the newlines after it
  (".\\n\\n"), but never a newline with the word after it;
* ``space``: before a single space between a non-space character and an ASCII letter
  ("word" | " next"): every one of these regexes starts a pre-token at such a space.

Which rules hold is not assumed: ``choose_rules`` checks each against whole-text
encodes on a battery of probe texts (``probe_texts``: letters, digits, punctuation
before a break, spaces and tabs around it, runs of 1-4 newlines, CRLF, contractions,
non-ASCII, combining marks) with a cut at every place the rule allows, and keeps only
the rules that pass every probe, for ``tokenizer.json`` shapes this reasoning covers
(``unsupported_reason``): no normaliser or NFC (which never composes across a newline
or a space), a ``ByteLevel`` pre-tokenizer without a prefix space (its GPT-2 regex
on, or after ``Split`` regexes that only look forward) and a BPE model without
dropout. Metaspace / SentencePiece-style tokenizers (Llama-2, Mistral) have no
pre-token boundaries (BPE runs over the whole text) and are refused.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "RULES",
    "CutRule",
    "Cutter",
    "bpe_reason",
    "choose_rules",
    "cutter_for",
    "per_tokenizer_json",
    "probe_texts",
    "unsupported_reason",
]

# a character that is not whitespace to Python's ``\s`` (a superset of Unicode's
# White_Space) nor one of the zero-width characters some regex engines count as space
_NON_SPACE = r"[^\s\u180e\u200b\u2060\ufeff]"


@dataclass(frozen=True, slots=True)
class CutRule:
    """A place a text may be cut: where ``pattern`` matches, at its start or end."""

    name: str
    pattern: str
    at_end: bool  # cut at the match's end (else its start)


RULES: tuple[CutRule, ...] = (
    CutRule("newline-after", rf"\n(?={_NON_SPACE})", at_end=True),
    CutRule("newline-before", rf"\n(?={_NON_SPACE})", at_end=False),
    CutRule("space", r"(?<=\S) (?=[A-Za-z])", at_end=False),
)


class Cutter:
    """Cuts a text into pieces of at least ``chunk_chars`` characters (the last one may
    be shorter) at the places ``rules`` allow. The cuts are chosen left to right, each
    the first allowed place at least ``chunk_chars`` after the previous one, so they
    depend only on the text up to them (and one character past): two texts that share
    a prefix share its pieces but the last one."""

    def __init__(self, rules: Sequence[CutRule], chunk_chars: int) -> None:
        if not rules:
            raise ValueError("a cutter needs at least one rule")
        self.rules = tuple(rules)
        self.chunk_chars = chunk_chars
        self._at_end = {f"r{i}": rule.at_end for i, rule in enumerate(rules)}
        self._pattern = re.compile(
            "|".join(f"(?P<r{i}>{rule.pattern})" for i, rule in enumerate(rules))
        )

    @property
    def name(self) -> str:
        return "+".join(rule.name for rule in self.rules)

    def cut(self, text: str) -> list[str]:
        """``text`` in pieces (one piece when it has no allowed place far enough in)."""
        pieces: list[str] = []
        search, at_end, step = self._pattern.search, self._at_end, self.chunk_chars
        start = 0
        while len(text) - start > step:
            match = search(text, start + step)
            if match is None:
                break
            group = match.lastgroup
            end = match.end() if group is not None and at_end[group] else match.start()
            if end >= len(text):
                break
            pieces.append(text[start:end])
            start = end
        pieces.append(text[start:])
        return pieces


Encode = Callable[[Sequence[str]], list[int]]  # the ids of texts, one after another
PreTokenize = Callable[[str], list[str]]


def _rule_holds(
    cutter: Cutter, encode: Encode, pre_tokenize: PreTokenize, texts: Sequence[str]
) -> bool:
    """Every text, cut by ``cutter``, has the pre-tokens and the ids of the whole."""
    for text in texts:
        pieces = cutter.cut(text)
        pre: list[str] = []
        for piece in pieces:
            pre += pre_tokenize(piece)
        if pre != pre_tokenize(text) or encode(pieces) != encode([text]):
            return False
    return True


def choose_rules(
    encode: Encode, pre_tokenize: PreTokenize, texts: Sequence[str], chunk_chars: int
) -> Cutter | None:
    """A cutter (``chunk_chars``) with the rules of ``RULES`` under which every probe
    text, cut at every place the rule allows, has the pre-tokens (``pre_tokenize``:
    the tokenizer's pre-tokenizer, so a cut is a boundary whatever the merges) and the
    ids (``encode``: of texts one after another, without special tokens) of the
    whole. None when no rule holds."""
    passing = [r for r in RULES if _rule_holds(Cutter([r], 1), encode, pre_tokenize, texts)]
    if any(r.name == "newline-after" for r in passing):  # both: the merges allow either
        passing = [r for r in passing if r.name != "newline-before"]
    while passing:  # the rules together must hold too (they should when each does)
        if _rule_holds(Cutter(passing, 1), encode, pre_tokenize, texts):
            return Cutter(passing, chunk_chars)
        passing.pop()
    return None


_BEFORE = ["word", "Word", "42", "x.", "x,", "x!", "x?", "x:", "x)", "x'", 'x"', "x-", "é",
           "日本", "x😀", "x's", "'ll", "x\u0301", "1.5", "x;", "x]", "x}", "x*"]  # fmt: skip
_BREAKS = [" ", "  ", "   ", "\t", " \t", "\n", "\n\n", "\n\n\n", "\n\n\n\n", "\r\n",
           "\r\n\r\n", " \n", "\n ", "  \n\n", "\t\n", "\n\t", "\n\n ", " \n \n", "\r",
           "\n\r\n", ".\n\n", "\u00a0\n", "\u3000 "]  # fmt: skip
_AFTER = ["word", "Word", "the", "42", "123456", "'s", "'t", "'re", "'ve", "'m", "'ll",
          "'d", "(x", "-", "--", "*", "#", "é", "É", "日本", "😀", "\u0301x", "Ωmega",
          "x", "I", "a.", ".x", "`code`", "'quoted'", '"q"', "_x", "{", "..."]  # fmt: skip
_WORDS = ["the", "of", "and", "to", "in", "is", "for", "tenant", "system", "prompt",
          "It's", "we'll", "don't", "THE", "x1", "2024", "3.14", "e.g.", "(see", "below)",
          "naïve", "café", "Zürich", "über", "日本語", "—", "–", "…", "«", "»", "😀",
          "def", "f(x)", "a_b", "#1", "$5", "100%", "a+b", "<tag>", "[1]"]  # fmt: skip
_SEPARATORS = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\n\n\n", " \n", "\t", "\r\n", ". ",
               ".\n\n", ",\n", ":\n  ", "\n- ", "\n\t", "\n\n\n\n"]  # fmt: skip


def probe_texts(seed: int = 14) -> list[str]:
    """The probe battery: every (before, break) and every (break, after) pair of the
    lists above, in triples, in a few long texts (joined by spaces, then by newlines),
    and random paragraphs of words, punctuation and blank lines."""
    triples = [f"{b}{s}{_AFTER[(i + j) % len(_AFTER)]}"
               for i, b in enumerate(_BEFORE) for j, s in enumerate(_BREAKS)]  # fmt: skip
    triples += [f"{_BEFORE[(i + j) % len(_BEFORE)]}{s}{a}"
                for i, a in enumerate(_AFTER) for j, s in enumerate(_BREAKS)]  # fmt: skip
    texts = [" ".join(triples[i : i + 400]) for i in range(0, len(triples), 400)]
    texts += ["\n".join(triples[i : i + 400]) for i in range(0, len(triples), 400)]
    rng = random.Random(seed)
    for _ in range(24):
        parts = []
        for _ in range(rng.randrange(20, 200)):
            parts += [rng.choice(_WORDS), rng.choice(_SEPARATORS)]
        texts.append("".join(parts))
    return texts


def _regex_looks_back(pattern: str) -> bool:
    """True when ``pattern`` may depend on what precedes a match: look-behind, word
    boundaries or anchors (a ``^`` inside a character class is not one)."""
    if re.search(r"\(\?<[=!]|\\[bBGAZz]", pattern):
        return True
    in_class, escaped = False, False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]" or pattern[i - 1] == "["
        elif ch == "[":
            in_class = True
        elif ch in "^$":
            return True
    return False


def _pre_tokenizer_reason(pre: Any) -> str | None:
    if not isinstance(pre, dict):
        return "no pre-tokenizer (BPE over the whole text)"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = 0
    for i, step in enumerate(steps):
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Split":
            regex = step.get("pattern", {}).get("Regex")
            if not isinstance(regex, str) or step.get("behavior") != "Isolated":
                return "a Split pre-tokenizer that is not an isolating regex"
            if step.get("invert") or _regex_looks_back(regex):
                return "a Split regex that looks behind or anchors"
            splits += 1
        elif kind == "ByteLevel" and i == len(steps) - 1:
            if step.get("add_prefix_space"):
                return "ByteLevel adds a prefix space"
            splits += 1 if step.get("use_regex", True) else 0
        else:
            return f"a {kind} pre-tokenizer (only byte-level BPE is understood)"
    if not steps or steps[-1].get("type") != "ByteLevel":
        return "not a byte-level pre-tokenizer"
    return None if splits else "no regex split before BPE"


def bpe_reason(spec: dict[str, Any]) -> str | None:
    """Why this parsed ``tokenizer.json`` is not a deterministic BPE without a
    normaliser other than NFC (None: it is)."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"a {normalizer.get('type')} normalizer"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model (only BPE is understood)"
    if model.get("dropout") not in (None, 0, 0.0):
        return "BPE dropout (random merges)"
    return None


def unsupported_reason(tokenizer_json: str) -> str | None:
    """Why the cut rules do not apply to this ``tokenizer.json`` (None: they may; the
    probes decide)."""
    spec = json.loads(tokenizer_json)
    return bpe_reason(spec) or _pre_tokenizer_reason(spec.get("pre_tokenizer"))


T = TypeVar("T")


def per_tokenizer_json(
    cache: dict[str, T], limit: int, tokenizer: Any, build: Callable[[str], T]
) -> T | str:
    """``build(tokenizer.json text)``, kept in ``cache`` (at most ``limit`` entries) per
    the text's digest: what is built from it is a pure function of it. A string: why the
    tokenizer's JSON could not be read."""
    try:
        text = tokenizer.to_str()
    except (AttributeError, TypeError) as exc:
        return f"tokenizer.json not readable ({type(exc).__name__})"
    key = hashlib.sha256(text.encode()).hexdigest()
    built = cache.get(key)
    if built is None:
        built = build(text)
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = built
    return built


_CHOSEN: dict[str, tuple[tuple[str, ...], str]] = {}  # tokenizer.json digest -> rules, why not
_MAX_CHOSEN = 32


def cutter_for(tokenizer: Any, chunk_chars: int) -> tuple[Cutter | None, str]:
    """The cutter for a ``tokenizers.Tokenizer`` (None, and why, when no rule holds or
    its shape is not understood). The probes take a few hundred milliseconds, so the
    rules found are kept per ``tokenizer.json`` content."""
    chosen = per_tokenizer_json(
        _CHOSEN, _MAX_CHOSEN, tokenizer, lambda spec: _choose(tokenizer, spec)
    )
    if isinstance(chosen, str):
        return None, chosen
    names, reason = chosen
    by_name = {rule.name: rule for rule in RULES}
    return (Cutter([by_name[n] for n in names], chunk_chars) if names else None), reason


def _choose(tokenizer: Any, spec: str) -> tuple[tuple[str, ...], str]:
    reason = unsupported_reason(spec)
    if reason is not None:
        return (), reason
    pre = tokenizer.pre_tokenizer

    def pre_tokenize(text: str) -> list[str]:
        return [p for p, _ in pre.pre_tokenize_str(text)]

    def encode(texts: Sequence[str]) -> list[int]:
        return [i for t in texts for i in tokenizer.encode(t, add_special_tokens=False).ids]

    cutter = choose_rules(encode, pre_tokenize, probe_texts(), 1)
    if cutter is None:
        return (), "no cut rule held on the probe texts"
    return tuple(rule.name for rule in cutter.rules), ""
