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

A Mooncake prompt also carries its runs' keys (``Prompt.run_keys``): the simulated
engine hashes the blocks of such a run from its key instead of its ids
(``sim.sequence``: one hash per 512-token run instead of one per 16-token block).

Ids of a run of text come from a blake2b hash of the run's key (``IdPool``), so equal
keys give equal ids in every process and distinct keys collide with probability
~2^-32 per pair (the twin's real text shares a leading 16-token chunk between distinct
blocks with probability 2^-16; both are negligible). Ids are opaque ints below 2^32,
not vocabulary ids.

**Unread ids** (``PromptIds(..., unread_for=block_size)``, what the simulator asks
for): a ``SimSequence`` of that block size never reads the ids of a unique tail (its
blocks hash from ``unique_key``) nor those of a keyed run other than a prompt's last
one (full run blocks hash from the run's key; only a partial block after the runs is
hashed from ids, and it lies in the last run). Those ids are then ``UNREAD`` (one
shared int object) instead of pool ids: the list has the prompt's length and every id
that is read, at a fraction of the cost (no pool slice touching thousands of distinct
int objects, no matching decrefs when it is freed: a Mooncake prompt's ~13,000 ids were
about a tenth of a simulated request's cost). Session prompts keep every id (a turn's
text is read again as the next turn's prefix). ``tests/unit/sim/test_sim_unread_ids.py``
checks that every block hash and prefix hash is the same either way.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from kiloserve.sim.sequence import UNIQUE_INDEX_BITS
from kiloserve.workload import RequestSpec, Workload, parse_workload_spec, read_trace
from kiloserve.workload.prompts import BLOCK_TOKENS
from kiloserve.workload.sessions import parse_sessions
from kiloserve.workload.synthetic import parse_prefix_groups

__all__ = ["RUN_TOKENS", "UNREAD", "IdPool", "Prompt", "PromptIds", "run_key"]

RUN_TOKENS = BLOCK_TOKENS  # tokens of a Mooncake hash id: the length of a keyed run
UNREAD = 0  # the id of a token whose id no simulated engine reads (module docstring)

POOL_SIZE = 1 << 18
_POOL_BASE = 1 << 31  # above the 32-bit first ids' typical range; all ids < 2^32


def run_key(key: str) -> tuple[int, int]:
    """(first id, offset) of the text named ``key``: a 64-bit blake2b hash, split."""
    value = _key_hash(key)
    return value & 0xFFFF_FFFF, value >> 32


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class Prompt(NamedTuple):
    """A prompt's ids, and where its request-unique text starts (for block hashing).

    ``unique_from`` is None when no tail is known to be unique (sessions: a later turn
    repeats this prompt); else every token from there on is text named by
    ``unique_key`` (a 64-bit hash of the unique run's name, low bits clear for the
    block index: ``SimSequence``) and by no other request.

    ``run_keys`` (Mooncake prompts): the first ``run_tokens`` ids are runs of
    ``RUN_TOKENS`` ids (the last one may be shorter), run ``r`` the text whose 64-bit
    key hash is ``run_keys[r]`` (``IdPool.hashed_run_ids``), so equal keys mean equal
    ids; ``SimSequence`` hashes those runs' full blocks from the keys.

    ``private_from`` (Mooncake prompts): the first keyed run whose hash id no other
    row of the trace lists, in tokens (None: none). Hash ids name whole prefixes, so
    from that run on the prompt's text is its own; the simulated engine keeps those
    blocks out of its prefix index as it does the unique tail's (``SimSequence``),
    while their hashes stay the keyed runs' (what the gateway sees is unchanged).
    """

    token_ids: list[int]
    unique_from: int | None = None
    unique_key: int = 0
    run_keys: tuple[int, ...] = ()
    run_tokens: int = 0
    private_from: int | None = None


class IdPool:
    """Shared id objects: a run of text is its own first id, then a slice of the pool.

    Slicing copies references instead of creating int objects, so a 1,000-token prompt
    costs a few microseconds. The first id (32 bits from the key's hash) makes runs of
    different keys differ from their first token on, so chained block hashes never
    collide through the shared slice (collision needs equal 32-bit first ids *and*
    equal offsets). A shorter run of a key is a prefix of a longer one; runs longer
    than half the pool fall back to fresh ints.
    """

    def __init__(self, size: int = POOL_SIZE) -> None:
        self._pool = list(range(_POOL_BASE, _POOL_BASE + size))
        self._size = size

    @property
    def ids(self) -> list[int]:
        """The pool itself (read-only by convention): a run's ids after its first."""
        return self._pool

    @property
    def half(self) -> int:
        """Runs start at ``offset % half``, so any run up to ``half`` ids fits."""
        return self._size // 2

    def run_ids(self, key: str, num_tokens: int) -> list[int]:
        """Deterministic ids of ``num_tokens`` tokens of text named ``key``."""
        return self.hashed_run_ids(_key_hash(key), num_tokens)

    def hashed_run_ids(self, key_hash: int, num_tokens: int) -> list[int]:
        """``run_ids`` of the key whose 64-bit hash (``run_key``'s) is ``key_hash``."""
        if num_tokens <= 0:
            return []
        first, offset = key_hash & 0xFFFF_FFFF, key_hash >> 32
        rest = num_tokens - 1
        half = self._size // 2
        if rest > half:  # beyond the pool: fresh ints (still deterministic)
            return [first, *range(_POOL_BASE + half, _POOL_BASE + half + rest)]
        start = offset % half  # independent of the length: a shorter run is a prefix
        if start == 0:
            return [first, *self._pool[:rest]]
        out = self._pool[start - 1 : start + rest]  # one copy, then its head replaced
        out[0] = first
        return out


class PromptIds:
    """Maps each ``RequestSpec`` of one workload to its prompt token ids."""

    def __init__(
        self,
        workload: Workload,
        traces_dir: str | Path | None = None,
        *,
        unread_for: int | None = None,
    ) -> None:
        """``unread_for``: the block size of the ``SimSequence`` these prompts feed; ids
        it never reads are then ``UNREAD`` (module docstring). None: every id."""
        text = workload.params.get("spec")
        # unique tails: their blocks hash from unique_key whatever the block size
        self._unread_tails = unread_for is not None
        # keyed runs but a prompt's last: hashed from their keys when the size divides them
        self._unread_runs = unread_for is not None and RUN_TOKENS % unread_for == 0
        self._kind = ""
        self._seed = workload.seed
        self._prefix_tokens = 0
        self._num_turns = 0
        self._system_tokens = 0
        self._hash_ids: Mapping[int, tuple[int, ...]] = {}
        self._num_rows: Counter[int] = Counter()
        self._keys: dict[int, int] = {}  # hash id -> its run's key hash, for one pass:
        self._keys_pass = 0  # this one
        self._sessions: dict[str, tuple[list[int], int]] = {}
        self._pool = IdPool()
        self.run_ids = self._pool.run_ids
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
            # rows listing each hash id (a pass replays every row once, with its own keys)
            self._num_rows = Counter(h for ids in self._hash_ids.values() for h in set(ids))

    def token_ids(self, spec: RequestSpec) -> list[int]:
        """The prompt's ids (exactly ``spec.input_tokens`` of them)."""
        return self.prompt(spec).token_ids

    def prompt(self, spec: RequestSpec) -> Prompt:
        """The prompt's ids and its unique tail (see ``Prompt``)."""
        num_tokens = max(1, spec.input_tokens)
        if spec.session_id is not None and self._kind == "sessions":
            return Prompt(self._session_ids(spec, num_tokens))
        ids: list[int] = []
        run_keys: tuple[int, ...] = ()
        private_from = None
        num_shared = 0  # leading ids of shared text (runs, a group's head)
        if spec.prefix_group is not None:
            if self._kind == "mooncake":
                ids, run_keys, private_from, num_shared = self._mooncake_ids(spec, num_tokens)
            elif self._prefix_tokens and spec.prefix_group.startswith("group-"):
                head = min(self._prefix_tokens, num_tokens)
                ids = self.run_ids(f"g/{self._seed}/{spec.prefix_group}", head)
                num_shared = len(ids)
        if num_shared >= num_tokens:
            return Prompt(ids, None, 0, run_keys, num_shared if run_keys else 0, private_from)
        key_hash = _key_hash(self._unique_name(spec.request_id))
        unique_from = num_shared
        if len(ids) < num_tokens:  # the tail is not written yet (a Mooncake list may hold it)
            if self._unread_tails:  # hashed from unique_key: no id of it is read
                tail = [UNREAD] * (num_tokens - unique_from)
            else:
                tail = self._pool.hashed_run_ids(key_hash, num_tokens - unique_from)
            if unique_from:
                ids += tail
            else:
                ids = tail
        unique_key = key_hash >> UNIQUE_INDEX_BITS << UNIQUE_INDEX_BITS
        run_tokens = unique_from if run_keys else 0
        return Prompt(ids, unique_from, unique_key, run_keys, run_tokens, private_from)

    def _unique_name(self, request_id: str) -> str:
        return f"u/{self._seed}/{request_id}"

    def _unique(self, name: str, num_tokens: int) -> list[int]:
        return self.run_ids(self._unique_name(name), num_tokens)

    def _mooncake_ids(
        self, spec: RequestSpec, num_tokens: int
    ) -> tuple[list[int], tuple[int, ...], int | None, int]:
        """The ids of the prompt's hash-id runs, the runs' key hashes, where the first
        run of a hash id no other row lists starts (``Prompt.private_from``) and how many
        ids the runs cover.

        A run is ``IdPool.hashed_run_ids`` of its key, written out here: its first id,
        then pool ids from the key's offset on. Keys are cached per hash id for the
        current pass (requests that share a prefix share its hash ids, and a blake2b
        hash costs more than the rest of the run); a new pass starts a new cache, so
        a trace repeated many times holds one pass's keys at most. With unread runs
        (``unread_for``) a run is ``UNREAD`` ids unless it ends the prompt.

        The list is made once at its final length and the read runs are written into
        it (growing it run by run reallocated and copied it a dozen times per prompt:
        a tenth of a Mooncake run's event loop); with unread tails it is the whole
        prompt's, its unique tail ``UNREAD`` already.
        """
        index = _trailing_int(spec.request_id)
        hash_ids = self._hash_ids.get(index, ()) if index is not None else ()
        # A repeated trace's pass k > 0 (request id NAME-rK-INDEX) has blocks of its own.
        k = _pass_of(spec.request_id)
        if k != self._keys_pass:
            self._keys_pass, self._keys = k, {}
        cache = self._keys
        pool, half = self._pool.ids, self._pool.half
        num_run_ids = min(num_tokens, RUN_TOKENS * len(hash_ids))
        ids = [UNREAD] * (num_tokens if self._unread_tails else num_run_ids)
        keys: list[int] = []
        pos = 0
        num_rows = self._num_rows
        private_from = None
        unread_runs = self._unread_runs
        for h in hash_ids:
            if pos >= num_tokens:
                break
            if private_from is None and num_rows[h] == 1:
                private_from = pos
            key = cache.get(h)
            if key is None:
                key = cache[h] = _key_hash(f"m/{h}" if k == 0 else f"m/{h}/r{k}")
            keys.append(key)
            left = num_tokens - pos
            size = min(RUN_TOKENS, left)
            if unread_runs and left > RUN_TOKENS:  # not the prompt's last run: unread
                pass
            elif size - 1 > half:  # a pool too small for a run (never with POOL_SIZE)
                ids[pos : pos + size] = self._pool.hashed_run_ids(key, size)
            else:
                ids[pos] = key & 0xFFFF_FFFF  # the run's first id
                start = (key >> 32) % half
                ids[pos + 1 : pos + size] = pool[start : start + size - 1]
            pos += size
        return ids, tuple(keys), private_from, pos

    def _session_ids(self, spec: RequestSpec, num_tokens: int) -> list[int]:
        session = spec.session_id or ""
        turn = _trailing_int(spec.request_id) or 0
        previous = self._sessions.pop(session, None) if turn > 0 else None
        ids: list[int] = []
        if previous is not None:
            prev_ids, prev_output = previous
            answer = self.run_ids(f"a/{self._seed}/{session}/{turn}", prev_output)
            if len(prev_ids) + prev_output < num_tokens:
                ids = prev_ids + answer
        elif self._system_tokens and self._system_tokens < num_tokens:
            ids = self.run_ids(f"s/{self._seed}", self._system_tokens)
        ids += self._unique(spec.request_id, num_tokens - len(ids))
        if turn + 1 < self._num_turns:
            self._sessions[session] = (ids, spec.output_tokens)
        return ids


def _pass_of(request_id: str) -> int:
    """The pass of a repeated trace's request (``mooncake-r3-000017`` -> 3), else 0."""
    parts = request_id.rsplit("-", 2)
    if len(parts) == 3 and parts[1][:1] == "r" and parts[1][1:].isdigit():
        return int(parts[1][1:])
    return 0


def _trailing_int(text: str) -> int | None:
    """The integer after the last ``-`` (``mooncake-000017`` -> 17, ``s00003-t2`` -> 2)."""
    tail = text.rsplit("-", 1)[-1].lstrip("t")
    try:
        return int(tail)
    except ValueError:
        return None
