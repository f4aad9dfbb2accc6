"""A model's real tokenizer with a cache of the ids of the pieces of its prompts.

HF ``tokenizers`` first splits a text on the added tokens (``<|im_start|>``,
``<|eot_id|>``, ...: matched whole, before normalisation and pre-tokenisation), then
encodes each segment between them on its own. A byte-level BPE tokenizer then splits
each segment into pre-tokens with a regex and never merges across them, so a segment
can be cut further, at places that are provably pre-token boundaries
(``kiloserve.gateway.pretoken_cuts``: after a newline run, before a space...). The ids
of a prompt are then the ids of its pieces one after another, and a piece seen before
(a tenant's system prompt, the earlier turns of a conversation, the shared head of a
completions prompt) need not be encoded again: ``ExactTokenizer.encode`` cuts the text
the same way (pieces of about ``PIECE_CHARS`` characters, cut left to right, so two
prompts that share a head share its pieces) and keeps the ids of recent pieces in a
bounded LRU (``SEGMENT_CACHE_SIZE`` pieces of at least ``MIN_CACHED_CHARS``
characters, ``SEGMENT_CACHE_CHARS`` in all). A 6k-token shared head then costs
dictionary lookups instead of a ~10 ms encode (benchmarks/prefix_overhead.py).

A wrong id would silently break prefix routing, so the cache is used only where it is
provably exact:

* added tokens: every one is matched verbatim (no ``lstrip`` / ``rstrip`` /
  ``single_word`` / ``normalized`` option; else no piece is cut at all);
* cuts inside a segment: only for ``tokenizer.json`` shapes whose pre-tokenisation
  is understood (byte-level BPE, no normaliser or NFC; Metaspace / SentencePiece-style
  tokenizers are refused), and only the cut rules that pass a battery of probe texts
  against whole-text encodes at load time (``pretoken_cuts.choose_rules``);
* a load-time self-check (pieces encoded apart == the whole encoded at once, with and
  without the post-processor's special tokens);
* at run time, one request in ``self_check_every`` (that was cut in pieces) is also
  encoded whole and compared: on a mismatch the piece cache turns off for the model
  for good, a WARNING names it, the request gets the whole text's ids, and
  ``describe()`` (``/admin/config`` ``tokenizer_piece_cache``, the gauge
  ``kiloserve_tokenizer_piece_cache``) says so.

Otherwise every text is encoded whole, as before. The post-processor's tokens (BOS...)
for ``add_special_tokens=True`` are the ones it adds around a one-piece text, found the
same way and checked.

The pieces are encoded by ``tiktoken`` where it gives the same ids (``fast_bpe``:
byte-level BPE of a supported shape, checked on probe texts at load; ``fast=True``),
~8x faster than ``tokenizers`` on a whole 8k-token prompt. Then every request that goes
through the pieces counts towards the self-check, and a difference turns the fast
encoder off for the model (the piece cache, filled by it, is emptied); if the pieces
encoded again by ``tokenizers`` differ too, the piece cache turns off as well.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from kiloserve.gateway.fast_bpe import FastEncoder, fast_encoder_for
from kiloserve.gateway.pretoken_cuts import Cutter, cutter_for

__all__ = [
    "MIN_CACHED_CHARS",
    "PIECE_CHARS",
    "SEGMENT_CACHE_CHARS",
    "SEGMENT_CACHE_SIZE",
    "SELF_CHECK_EVERY",
    "ExactTokenizer",
]

log = logging.getLogger(__name__)

SEGMENT_CACHE_SIZE = 65_536  # pieces
SEGMENT_CACHE_CHARS = 16 * 1024 * 1024  # and at most this much text (bounded memory)
MIN_CACHED_CHARS = 256
PIECE_CHARS = 1024  # a segment is cut into pieces of at least this many characters
SELF_CHECK_EVERY = 500  # one cut request in this many is also encoded whole
_PROBE = "hello world, the quick brown fox\n  jumps over 12 lazy dogs."


class ExactTokenizer:
    """A model's ``tokenizer.json`` (``tokenizers``) and chat template (None: the model
    has none; its chat prompts are then counted approximately). ``name``: the model,
    for logs; ``self_check_every``: one cut request in this many is checked against
    the whole text's encode (0: never); ``piece_chars``: the pieces' length (None: cut
    only at added tokens, as before pre-token cuts; the benchmark's baseline)."""

    def __init__(
        self,
        tokenizer: Any,
        template: Any,
        *,
        name: str = "",
        self_check_every: int = SELF_CHECK_EVERY,
        piece_chars: int | None = PIECE_CHARS,
        fast: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self.template = template
        self.name = name
        self.self_check_every = self_check_every
        self._piece_chars = piece_chars
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._on = False  # cut texts in pieces (at added tokens, and by ``_cutter``)
        self._split: re.Pattern[str] | None = None  # added tokens, captured
        self._cutter: Cutter | None = None
        self._added_ids: dict[str, int] = {}
        self._wrap: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._why_not_cut = ""
        self._disabled = ""  # why the runtime self-check turned the cache off
        self._num_cut = 0
        self.num_self_checks = 0
        self._fast: FastEncoder | None = None
        self._why_not_fast = "" if fast else "turned off"
        self._probe = ""  # the load-time self-check's text
        self._enable_segments()
        if self._on and fast:
            self._fast, self._why_not_fast = fast_encoder_for(tokenizer)
            if self._fast is not None and not self._pieces_agree():
                self._fast, self._why_not_fast = None, "the load-time self-check failed"
            log.info("model %s: pieces are encoded by %s%s", name or "?", self.encoder,
                     f" ({self._why_not_fast})" if self._why_not_fast else "")  # fmt: skip

    @property
    def caches_segments(self) -> bool:
        """True while texts are cut in pieces whose ids are cached."""
        return self._on

    @property
    def encoder(self) -> str:
        """What encodes the pieces: ``tiktoken`` (the fast encoder) or ``tokenizers``."""
        return "tiktoken" if self._fast is not None else "tokenizers"

    @property
    def cut_rule(self) -> str | None:
        """The rules that cut inside a segment (``newline-after+space``...), or None."""
        return self._cutter.name if self._on and self._cutter is not None else None

    def describe(self) -> dict[str, Any]:
        """The piece cache's state: ``on`` / ``off``, where it cuts, and why not."""
        state: dict[str, Any] = {
            "state": "on" if self._on else "off",
            "added_tokens": self._on and self._split is not None,
            "cut_rule": self.cut_rule,
            "self_checks": self.num_self_checks,
            "self_check_every": self.self_check_every,
            "pieces_cached": len(self._cache),
            "encoder": self.encoder,
        }
        if self._fast is None and self._why_not_fast:
            state["no_fast_encoder"] = self._why_not_fast
        if self._disabled:
            state["disabled"] = self._disabled
        elif self._on and self._cutter is None:
            state["no_cuts"] = self._why_not_cut
        return state

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: the post-processor's (BOS...)."""
        if not self._on or (add_special_tokens and self._wrap is None):
            return self._encode_whole(text, add_special_tokens)
        ids, num_pieces = self._encode_cut(text, add_special_tokens)
        if (num_pieces > 1 or self._fast is not None) and self.self_check_every > 0:
            self._num_cut += 1
            if self._num_cut % self.self_check_every == 0:
                return self._self_check(text, add_special_tokens, ids)
        return ids

    def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _encode_cut(
        self, text: str, add_special_tokens: bool, cached: bool = True
    ) -> tuple[list[int], int]:
        """``_encode_pieces``, with the post-processor's tokens when asked for."""
        ids, num_pieces = self._encode_pieces(text, cached)
        if add_special_tokens and self._wrap is not None:
            before, after = self._wrap
            ids = [*before, *ids, *after]
        return ids, num_pieces

    def _encode_pieces(self, text: str, cached: bool = True) -> tuple[list[int], int]:
        """The ids of ``text`` from its pieces, and how many pieces it had (``cached``:
        through the piece cache, else each piece encoded anew)."""
        piece_ids = self._piece_ids if cached else self._encode_piece
        out: list[int] = []
        num_pieces = 0
        added, cutter = self._added_ids, self._cutter
        segments = self._split.split(text) if self._split is not None else [text]
        for i, segment in enumerate(segments):
            if not segment:
                continue
            if i % 2:  # the captured separators: added tokens
                out.append(added[segment])
                num_pieces += 1
                continue
            cut = cutter is not None and len(segment) > cutter.chunk_chars
            pieces = cutter.cut(segment) if cut and cutter is not None else (segment,)
            num_pieces += len(pieces)
            for piece in pieces:
                out += piece_ids(piece)
        return out, num_pieces

    def _encode_piece(self, piece: str) -> list[int]:
        """One piece's ids: by the fast encoder while it is on, else by ``tokenizers``."""
        fast = self._fast
        if fast is not None:
            return fast.encode(piece)
        return self._tokenizer.encode(piece, add_special_tokens=False).ids  # type: ignore[no-any-return]

    def _piece_ids(self, piece: str) -> tuple[int, ...] | list[int]:
        if len(piece) < MIN_CACHED_CHARS:
            return self._encode_piece(piece)
        cache = self._cache
        with self._lock:
            ids = cache.get(piece)
            if ids is not None:
                cache.move_to_end(piece)
                return ids
        ids = tuple(self._encode_piece(piece))
        with self._lock:
            if piece not in cache:
                cache[piece] = ids
                self._cached_chars += len(piece)
            while len(cache) > SEGMENT_CACHE_SIZE or self._cached_chars > SEGMENT_CACHE_CHARS:
                self._cached_chars -= len(cache.popitem(last=False)[0])
        return ids

    def _self_check(self, text: str, add_special_tokens: bool, ids: list[int]) -> list[int]:
        """The whole text's ids; when they differ from the pieces' ``ids``, the piece
        cache turns off for good (a WARNING names the model, never the text)."""
        self.num_self_checks += 1
        whole = self._encode_whole(text, add_special_tokens)
        if whole != ids and self._fast is not None:
            # the fast encoder, or the cuts? the pieces again, by tokenizers, decide
            self._turn_off_fast("self-check mismatch of the fast encoder")
            if self._encode_cut(text, add_special_tokens, cached=False)[0] == whole:
                return whole
        if whole != ids and self._on:
            first = next((i for i, (a, b) in enumerate(zip(ids, whole, strict=False)) if a != b),
                         min(len(ids), len(whole)))  # fmt: skip
            self._turn_off(
                f"self-check mismatch: {len(ids)} ids from pieces, {len(whole)} from the "
                f"whole text, first difference at token {first}"
            )
            log.warning(
                "model %s: the tokenizer's piece cache gave ids that differ from the "
                "whole text's (%s); it is off for this model from now on (every prompt "
                "is encoded whole)", self.name or "?", self._disabled,
            )  # fmt: skip
        return whole

    def _turn_off_fast(self, reason: str) -> None:
        """The fast encoder gave other ids than ``tokenizers``: off for good, and the
        pieces it encoded forgotten (they stay on, encoded by ``tokenizers``)."""
        self._fast = None
        self._why_not_fast = reason
        with self._lock:
            self._cache.clear()
            self._cached_chars = 0
        log.warning(
            "model %s: the fast encoder (tiktoken) gave ids that differ from tokenizers' "
            "on a prompt; it is off for this model from now on", self.name or "?",
        )  # fmt: skip

    def _pieces_agree(self) -> bool:
        """The load-time self-check: the probe's pieces give the whole probe's ids."""
        return self._encode_pieces(self._probe)[0] == self._encode_whole(self._probe, False)

    def _turn_off(self, reason: str) -> None:
        self._on = False
        self._disabled = reason
        with self._lock:
            self._cache.clear()
            self._cached_chars = 0

    def _enable_segments(self) -> None:
        """Turn the piece cache on when its cuts are provably the tokenizer's."""
        try:
            added = list(self._tokenizer.get_added_tokens_decoder().items())
        except AttributeError:
            return
        flags = ("lstrip", "rstrip", "single_word", "normalized")
        if any(getattr(token, flag, True) for _, token in added for flag in flags):
            return  # matched with options: not a verbatim split
        self._cutter = self._choose_cutter() if self._piece_chars is not None else None
        probe = f"{_PROBE * 20} {_PROBE}\n\n{_PROBE * 30}"
        if added:
            self._added_ids = {token.content: token_id for token_id, token in added}
            contents = sorted(self._added_ids, key=len, reverse=True)  # leftmost-longest
            self._split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")
            tokens = contents[:2] if len(contents) > 1 else contents * 2
            probe = f"{tokens[0]}{_PROBE * 20}{tokens[1]} {_PROBE}\n{tokens[0]}x{_PROBE * 30}"
        elif self._cutter is None:
            return  # nothing to cut at
        self._on = True
        self._probe = probe
        if not self._pieces_agree():
            self._turn_off("the load-time self-check failed")
            self._split, self._cutter = None, None
            return
        self._wrap = self._find_wrap(probe)

    def _choose_cutter(self) -> Cutter | None:
        """The cut rules that hold for this tokenizer (``pretoken_cuts``), or None."""
        cutter, reason = cutter_for(self._tokenizer, self._piece_chars or PIECE_CHARS)
        if cutter is not None:
            log.info("model %s: prompts are cut at %s", self.name or "?", cutter.name)
            return cutter
        self._why_not_cut = reason
        log.info("model %s: prompts are cut only at added tokens: %s", self.name or "?", reason)
        return None

    def _find_wrap(self, probe: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """What the post-processor adds around a text, if it is the same for any text."""
        plain = self._encode_whole(_PROBE, False)
        full = self._encode_whole(_PROBE, True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                wrap = (tuple(full[:start]), tuple(full[start + len(plain) :]))
                expected = [*wrap[0], *self._encode_whole(probe, False), *wrap[1]]
                return wrap if expected == self._encode_whole(probe, True) else None
        return None
