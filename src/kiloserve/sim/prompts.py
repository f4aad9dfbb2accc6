"""Prompt token ids for simulated requests, derived from a ``RequestSpec`` without text.

The simulator builds workloads with ``with_prompts=False`` (no text, no tokenizing);
what matters for prefix caching and prefix-aware routing is which requests share which
prefix, not the ids themselves. The prefix structure follows the workload library's
prompts (``kiloserve.workload.prompts``):

* ``synthetic`` with ``prefix_groups``: requests of group ``g`` share a
  ``prefix_tokens``-token head; the rest is unique to the request.
* Mooncake trace rows: one 512-token block per ``hash_id`` (shared by every request
  listing it; the trace is read once to recover each row's ids), the rest unique.
* ``sessions``: turn k's prompt is turn k-1's prompt, then the previous answer, then
  new text (an optional ``system_tokens`` head is shared by every session).
* anything else: unique text.

Ids of a run of text are ``base + i * stride`` with ``base`` and ``stride`` from a
blake2b hash of the run's key, so equal keys give equal ids in every process and
distinct keys collide with probability ~2^-40 (the twin's real text shares a leading
16-token chunk between distinct blocks with probability 2^-16; both are negligible).
Ids are opaque ints below 2^32 (the block hash packs them as uint32), not vocabulary ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from kiloserve.workload import RequestSpec, Workload, parse_workload_spec, read_trace
from kiloserve.workload.prompts import BLOCK_TOKENS
from kiloserve.workload.sessions import parse_sessions
from kiloserve.workload.synthetic import parse_prefix_groups

__all__ = ["PromptIds"]

_MAX_BASE = 1 << 30
_MAX_STRIDE = 1 << 11


def run_ids(key: str, num_tokens: int) -> list[int]:
    """Deterministic ids of ``num_tokens`` tokens of text named ``key``."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    base = value % _MAX_BASE
    stride = 1 + (value >> 32) % _MAX_STRIDE
    return list(range(base, base + num_tokens * stride, stride))


class PromptIds:
    """Maps each ``RequestSpec`` of one workload to its prompt token ids."""

    def __init__(self, workload: Workload, traces_dir: str | Path | None = None) -> None:
        text = workload.params.get("spec")
        self._kind = ""
        self._seed = workload.seed
        self._prefix_tokens = 0
        self._num_turns = 0
        self._system_tokens = 0
        self._hash_ids: Mapping[int, tuple[int, ...]] = {}
        self._sessions: dict[str, tuple[list[int], int]] = {}
        if isinstance(text, str):
            self._configure(text, traces_dir)

    def _configure(self, text: str, traces_dir: str | Path | None) -> None:
        parsed = parse_workload_spec(text)
        self._kind = parsed.kind
        if parsed.kind == "synthetic":
            groups = parse_prefix_groups(parsed.options)
            self._prefix_tokens = groups.prefix_tokens if groups.is_enabled else 0
        elif parsed.kind == "sessions":
            config = parse_sessions(parsed.options)
            self._num_turns = config.num_turns
            self._system_tokens = config.system_tokens
        elif parsed.kind == "mooncake":
            rows = read_trace("mooncake", traces_dir)
            self._hash_ids = {i: r.hash_ids for i, r in enumerate(rows) if r.hash_ids}

    def token_ids(self, spec: RequestSpec) -> list[int]:
        """The prompt's ids (exactly ``spec.input_tokens`` of them)."""
        num_tokens = max(1, spec.input_tokens)
        if spec.session_id is not None and self._kind == "sessions":
            return self._session_ids(spec, num_tokens)
        if spec.prefix_group is not None:
            if self._kind == "mooncake":
                return self._mooncake_ids(spec, num_tokens)
            if self._prefix_tokens and spec.prefix_group.startswith("group-"):
                return self._group_ids(spec, num_tokens)
        return self._unique(spec.request_id, num_tokens)

    def _unique(self, name: str, num_tokens: int) -> list[int]:
        return run_ids(f"u/{self._seed}/{name}", num_tokens)

    def _group_ids(self, spec: RequestSpec, num_tokens: int) -> list[int]:
        head = min(self._prefix_tokens, num_tokens)
        ids = run_ids(f"g/{self._seed}/{spec.prefix_group}", head)
        if num_tokens > head:
            ids += self._unique(spec.request_id, num_tokens - head)
        return ids

    def _mooncake_ids(self, spec: RequestSpec, num_tokens: int) -> list[int]:
        index = _trailing_int(spec.request_id)
        hash_ids = self._hash_ids.get(index, ()) if index is not None else ()
        ids: list[int] = []
        for h in hash_ids:
            left = num_tokens - len(ids)
            if left <= 0:
                break
            ids += run_ids(f"m/{h}", min(BLOCK_TOKENS, left))
        if len(ids) < num_tokens:
            ids += self._unique(spec.request_id, num_tokens - len(ids))
        return ids

    def _session_ids(self, spec: RequestSpec, num_tokens: int) -> list[int]:
        session = spec.session_id or ""
        turn = _trailing_int(spec.request_id) or 0
        previous = self._sessions.pop(session, None) if turn > 0 else None
        ids: list[int] = []
        if previous is not None:
            prev_ids, prev_output = previous
            answer = run_ids(f"a/{self._seed}/{session}/{turn}", prev_output)
            if len(prev_ids) + prev_output < num_tokens:
                ids = prev_ids + answer
        elif self._system_tokens and self._system_tokens < num_tokens:
            ids = run_ids(f"s/{self._seed}", self._system_tokens)
        ids += self._unique(spec.request_id, num_tokens - len(ids))
        if turn + 1 < self._num_turns:
            self._sessions[session] = (ids, spec.output_tokens)
        return ids


def _trailing_int(text: str) -> int | None:
    """The integer after the last ``-`` (``mooncake-000017`` -> 17, ``s00003-t2`` -> 2)."""
    tail = text.rsplit("-", 1)[-1].lstrip("t")
    try:
        return int(tail)
    except ValueError:
        return None
