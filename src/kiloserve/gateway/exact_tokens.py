"""A model's real tokenizer with a cache of the text between its added tokens.

HF ``tokenizers`` first splits a text on the added tokens (``<|im_start|>``,
``<|eot_id|>``, ...: matched whole, before normalisation and pre-tokenisation), then
encodes each piece between them on its own. So the ids of a rendered chat prompt are
the concatenation of the ids of its pieces, and a piece seen before (a tenant's system
prompt, the earlier turns of a conversation, an agent's tool list) need not be
encoded again: ``ExactTokenizer.encode`` splits the text the same way and keeps the
ids of recent pieces in a bounded LRU (``SEGMENT_CACHE_SIZE`` pieces of at least
``MIN_CACHED_CHARS`` characters, ``SEGMENT_CACHE_CHARS`` in all). On prefix-heavy
chat traffic that turns a 6k-token system prompt's ~20-30 ms encode into a dictionary
lookup (benchmarks/prefix_overhead.py); a completions prompt has no added tokens to
split on, so it is encoded whole every time.

The split must be the tokenizer's own or the ids would differ, so the cache is used
only when it provably is: every added token is matched verbatim (no ``lstrip`` /
``rstrip`` / ``single_word`` / ``normalized`` option), and a self-check at load time
(pieces encoded apart == the whole encoded at once, with and without the
post-processor's special tokens) passes. Otherwise every text is encoded whole, as
before. The post-processor's tokens (BOS...) for ``add_special_tokens=True`` are the
ones it adds around a one-piece text, found the same way and checked.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

__all__ = ["MIN_CACHED_CHARS", "SEGMENT_CACHE_CHARS", "SEGMENT_CACHE_SIZE", "ExactTokenizer"]

SEGMENT_CACHE_SIZE = 4096
SEGMENT_CACHE_CHARS = 16 * 1024 * 1024  # and at most this much text (bounded memory)
MIN_CACHED_CHARS = 256
_PROBE = "hello world, the quick brown fox\n  jumps over 12 lazy dogs."


class ExactTokenizer:
    """A model's ``tokenizer.json`` (``tokenizers``) and chat template (None: the model
    has none; its chat prompts are then counted approximately)."""

    def __init__(self, tokenizer: Any, template: Any) -> None:
        self._tokenizer = tokenizer
        self.template = template
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._split: re.Pattern[str] | None = None
        self._added_ids: dict[str, int] = {}
        self._wrap: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._enable_segments()

    @property
    def caches_segments(self) -> bool:
        return self._split is not None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: the post-processor's (BOS...)."""
        split = self._split
        if split is None or (add_special_tokens and self._wrap is None):
            return self._encode_whole(text, add_special_tokens)
        ids = self._encode_pieces(split, text)
        if add_special_tokens and self._wrap is not None:
            before, after = self._wrap
            return [*before, *ids, *after]
        return ids

    def _encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _encode_pieces(self, split: re.Pattern[str], text: str) -> list[int]:
        out: list[int] = []
        added, cache = self._added_ids, self._cache
        for i, piece in enumerate(split.split(text)):
            if not piece:
                continue
            if i % 2:  # the captured separators: added tokens
                out.append(added[piece])
                continue
            if len(piece) < MIN_CACHED_CHARS:
                out += self._tokenizer.encode(piece, add_special_tokens=False).ids
                continue
            ids = cache.get(piece)
            if ids is None:
                ids = tuple(self._tokenizer.encode(piece, add_special_tokens=False).ids)
                cache[piece] = ids
                self._cached_chars += len(piece)
                while len(cache) > SEGMENT_CACHE_SIZE or self._cached_chars > SEGMENT_CACHE_CHARS:
                    self._cached_chars -= len(cache.popitem(last=False)[0])
            else:
                cache.move_to_end(piece)
            out += ids
        return out

    def _enable_segments(self) -> None:
        """Turn the piece cache on when the split is provably the tokenizer's."""
        try:
            added = list(self._tokenizer.get_added_tokens_decoder().items())
        except AttributeError:
            return
        if not added:
            return
        for _, token in added:
            flags = ("lstrip", "rstrip", "single_word", "normalized")
            if any(getattr(token, flag, True) for flag in flags):
                return  # matched with options: not a verbatim split
        self._added_ids = {token.content: token_id for token_id, token in added}
        contents = sorted(self._added_ids, key=len, reverse=True)  # leftmost-longest
        split = re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")
        tokens = contents[:2] if len(contents) > 1 else contents * 2
        probe = f"{tokens[0]}{_PROBE}{tokens[1]} {_PROBE}\n{tokens[0]}x{_PROBE * 3}"
        if self._encode_pieces(split, probe) != self._encode_whole(probe, False):
            self._cache.clear()
            self._cached_chars = 0
            return
        self._split = split
        self._wrap = self._find_wrap(probe)

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
