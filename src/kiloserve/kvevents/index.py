"""The exact prefix index: which backend holds which prompt blocks, from KV events.

Built from the engines' own ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events (``kvevents.wire``), never from guesses. The engines' block hashes are opaque
(vLLM's depend on its hash algorithm and a per-process seed), so every stored block
is re-hashed the gateway's way from the token ids the event carries:
``tokens.prefix_block_hashes`` chained from the parent block's local hash, or from
``tokens.cache_seed(lora_name, cache_salt)`` for a prompt's first block. A request's
``RequestInfo.prefix_hashes`` are computed the same way, so a lookup is a walk over
the request's hashes. Engine hash -> local hashes is kept per backend for removals.

* Block sizes: the gateway hashes ``block_size``-token blocks; an engine block of
  ``k * block_size`` tokens becomes ``k`` local hashes (a size that is not a multiple
  is rejected and counted: ``mismatched``).
* Extra keys: LoRA name and cache salt seed the chain; multimodal identifiers are
  folded into the hash of the block they touch, so such a block never matches a
  text-only prompt (the gateway does not hash images).
* Only the GPU tier (``medium`` GPU or unset) is indexed; other tiers are counted.
* A stored block whose parent this index never saw (events lost, or stored before the
  subscription) cannot be chained: it is skipped and counted (``orphans``).
* Each backend holds at most ``max_blocks_per_backend`` engine blocks; past it the
  backend's entries are dropped (``overflows``): a publisher that never sends
  removals cannot grow the gateway without bound.

``IdentityHasher`` is for publishers whose engine hashes already are the gateway's
local hashes (the simulator's engines), skipping the re-hash; ``match_depths`` and the
bookkeeping are the same code, except that such an index stores each block's engine
hash as its own local hash (an ``int``, not a 1-tuple) in one loop per event: the
simulator's long prompts store and remove hundreds of blocks per event.

Holders are immutable: a block held by one backend maps to that backend's one shared
``frozenset`` (made once per backend), so storing a block nobody else holds allocates
nothing; a block held by several maps to its own frozenset, replaced on each change.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Protocol, cast

from kiloserve.errors import ConfigError
from kiloserve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event
from kiloserve.tokens import cache_seed

__all__ = ["IdentityHasher", "IndexCounters", "KvBlockIndex", "LocalHasher", "TokenHasher"]

GPU_MEDIA = frozenset({None, "GPU", "gpu"})


class LocalHasher(Protocol):
    needs_parent: bool  # False: a block's local hash does not depend on its parent's

    def local_hashes(self, event: BlockStored, prev: int) -> list[tuple[int, ...]] | None:
        """Per stored engine block, its local hashes chained from ``prev``; None when
        the event cannot be hashed (block size not a multiple of the index's)."""
        ...


def _mm_keys(extra: tuple[Any, ...] | None, lora_name: str | None) -> tuple[Any, ...]:
    """The multimodal part of one block's extra keys (LoRA name and salt excluded)."""
    if not extra:
        return ()
    items = extra[1:] if lora_name is not None and extra[0] == lora_name else extra
    return tuple(tuple(k) if isinstance(k, list) else k for k in items if not isinstance(k, str))


def _salt(extra: tuple[Any, ...] | None, lora_name: str | None) -> str | None:
    if not extra:
        return None
    items = extra[1:] if lora_name is not None and extra[0] == lora_name else extra
    salts = [k for k in items if isinstance(k, str)]
    return salts[0] if salts else None


class TokenHasher:
    """Re-hashes each block from the event's token ids (vLLM, the twin)."""

    needs_parent = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def local_hashes(self, event: BlockStored, prev: int) -> list[tuple[int, ...]] | None:
        size, engine_size = self.block_size, event.block_size
        if engine_size % size:
            return None
        tokens, extras = event.token_ids, event.extra_keys
        out: list[tuple[int, ...]] = []
        for i in range(len(event.block_hashes)):
            start = i * engine_size
            block = tokens[start : start + engine_size]
            if len(block) < engine_size:
                break  # a partial block (not cached by prefix): nothing to index
            mm = _mm_keys(extras[i], event.lora_name) if extras and i < len(extras) else ()
            subs: list[int] = []
            for j in range(0, engine_size, size):
                chunk = tuple(block[j : j + size])
                prev = hash((prev, chunk, mm)) if mm and j == 0 else hash((prev, chunk))
                subs.append(prev)
            out.append(tuple(subs))
        return out


class IdentityHasher:
    """Engine hashes are local hashes already (one per block, same block size), so a
    block whose parent this index does not hold is indexed all the same (a lookup walks
    from the first block and stops where the chain breaks, as the engine's does)."""

    needs_parent = False

    def local_hashes(self, event: BlockStored, prev: int) -> list[tuple[int, ...]] | None:
        return [(h,) for h in event.block_hashes if isinstance(h, int)]


@dataclass(slots=True)
class IndexCounters:
    """What the index did with the events it was given (``KvEventCache`` exports them)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    mismatched: int = 0
    other_media: int = 0
    overflows: int = 0


class KvBlockIndex:
    """Local block hash -> backends holding it, kept exact by events."""

    def __init__(
        self,
        block_size: int = 16,
        hasher: LocalHasher | None = None,
        max_blocks_per_backend: int = 4_000_000,
    ) -> None:
        if block_size < 1 or max_blocks_per_backend < 1:
            raise ConfigError("block_size and max_blocks_per_backend must be >= 1")
        self.block_size = block_size
        self.hasher: LocalHasher = hasher or TokenHasher(block_size)
        self.max_blocks_per_backend = max_blocks_per_backend
        # block -> its holders: one backend's shared frozenset({backend}) (_only), or a
        # set of the block's own when several hold it (added to in place: a union per
        # new holder copied sets of hundreds of backends at 1,024 GPUs)
        self._holders: dict[int, frozenset[str] | set[str]] = {}
        self._only: dict[str, frozenset[str]] = {}  # backend -> frozenset({backend})
        # per backend: engine hash -> its local hashes (an int: the hash itself, identity)
        self._blocks: dict[str, dict[EngineHash, tuple[int, ...] | int]] = {}
        self._identity = isinstance(self.hasher, IdentityHasher)
        self._engine_block_sizes: dict[str, int] = {}  # per backend, from its events
        self.counters = IndexCounters()

    # -- reading ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Distinct local blocks held by at least one backend."""
        return len(self._holders)

    def num_backend_blocks(self, backend_id: str) -> int:
        """Engine blocks indexed for ``backend_id``."""
        return len(self._blocks.get(backend_id, ()))

    def backends(self) -> list[str]:
        return list(self._blocks)

    def engine_block_size(self, backend_id: str) -> int | None:
        """The block size ``backend_id``'s events use (None before its first store)."""
        return self._engine_block_sizes.get(backend_id)

    def match_depths(
        self, prefix_hashes: Sequence[int], among: Collection[str] | None = None
    ) -> dict[str, int]:
        """Backend -> number of leading blocks of ``prefix_hashes`` it holds (> 0),
        optionally only for backends in ``among``."""
        if not prefix_hashes:
            return {}
        holders = self._holders
        first = holders.get(prefix_hashes[0])
        if not first:
            return {}
        active = set(first) if among is None else {b for b in first if b in among}
        depths: dict[str, int] = {}
        depth = 1
        for block_hash in prefix_hashes[1:]:
            if not active:
                break
            held = holders.get(block_hash)
            if held is None:
                break
            gone = active - held
            if gone:
                for backend_id in gone:
                    depths[backend_id] = depth
                active -= gone
            depth += 1
        for backend_id in active:
            depths[backend_id] = depth
        return depths

    # -- writing ---------------------------------------------------------------------
    def apply(self, backend_id: str, events: Iterable[Event]) -> None:
        """Apply one batch's events for ``backend_id``, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(backend_id, event)
            elif isinstance(event, BlockRemoved):
                self._remove(backend_id, event)
            elif isinstance(event, AllBlocksCleared):
                self.counters.cleared += 1
                self.clear_backend(backend_id)

    def clear_backend(self, backend_id: str) -> None:
        """Forget everything ``backend_id`` holds (restart, lost stream, removal)."""
        blocks = self._blocks.pop(backend_id, None)
        if blocks:
            for subs in blocks.values():
                self._release(backend_id, subs)

    def _only_holder(self, backend_id: str) -> frozenset[str]:
        """The one shared ``frozenset({backend_id})``."""
        only = self._only.get(backend_id)
        if only is None:
            only = self._only[backend_id] = frozenset((backend_id,))
        return only

    def _hold(self, backend_id: str, subs: Iterable[int]) -> None:
        """``backend_id`` holds the local blocks ``subs`` (too)."""
        holders = self._holders
        only = self._only_holder(backend_id)
        for sub in subs:
            held = holders.setdefault(sub, only)  # one lookup for a block nobody held
            if held is not only and backend_id not in held:
                if isinstance(held, frozenset):  # another backend's only: a set of its own
                    holders[sub] = {*held, backend_id}
                else:
                    held.add(backend_id)

    def _release(self, backend_id: str, subs: tuple[int, ...] | int) -> None:
        """``backend_id`` no longer holds the local blocks ``subs``."""
        if isinstance(subs, int):
            self._release_one(backend_id, subs)
            return
        for sub in subs:
            self._release_one(backend_id, sub)

    def _release_one(self, backend_id: str, sub: int) -> None:
        holders = self._holders
        held = holders.get(sub)
        if held is None or backend_id not in held:
            return
        if len(held) == 1:
            del holders[sub]
            return
        if len(held) == 2:  # one left: its shared frozenset
            first, second = held
            holders[sub] = self._only_holder(second if first == backend_id else first)
            return
        cast("set[str]", held).discard(backend_id)  # (several: the block's own set)

    def _store(self, backend_id: str, event: BlockStored) -> None:
        counters = self.counters
        if event.medium not in GPU_MEDIA:
            counters.other_media += 1
            return
        blocks = self._blocks.get(backend_id)
        if blocks is None:
            blocks = self._blocks[backend_id] = {}
        if self._identity:
            self._store_identity(backend_id, blocks, event)
            return
        parent = event.parent_block_hash
        if parent is None:
            first_extra = event.extra_keys[0] if event.extra_keys else None
            prev = cache_seed(event.lora_name, _salt(first_extra, event.lora_name))
        else:
            parent_subs = blocks.get(parent)
            if parent_subs is not None:
                prev = parent_subs if isinstance(parent_subs, int) else parent_subs[-1]
            elif self.hasher.needs_parent:
                counters.orphans += 1
                return
            else:
                prev = 0
        per_block = self.hasher.local_hashes(event, prev)
        if per_block is None:
            counters.mismatched += 1
            return
        self._engine_block_sizes[backend_id] = event.block_size
        for engine_hash, subs in zip(event.block_hashes, per_block, strict=False):
            blocks[engine_hash] = subs
            self._hold(backend_id, subs)
        counters.stored += len(per_block)
        if len(blocks) > self.max_blocks_per_backend:
            counters.overflows += 1
            self.clear_backend(backend_id)

    def _store_identity(
        self, backend_id: str, blocks: dict[EngineHash, tuple[int, ...] | int], event: BlockStored
    ) -> None:
        """``_store`` for an ``IdentityHasher`` index: each int engine hash is its own
        local hash (no parent needed; non-int hashes are skipped, as the hasher does)."""
        self._engine_block_sizes[backend_id] = event.block_size
        hashes: tuple[int, ...]
        if all(map(isinstance, event.block_hashes, repeat(int))):  # loops in C
            hashes = cast("tuple[int, ...]", event.block_hashes)
        else:
            hashes = tuple(h for h in event.block_hashes if isinstance(h, int))
        blocks.update(zip(hashes, hashes, strict=True))
        self._hold(backend_id, hashes)
        self.counters.stored += len(hashes)
        if len(blocks) > self.max_blocks_per_backend:
            self.counters.overflows += 1
            self.clear_backend(backend_id)

    def _remove(self, backend_id: str, event: BlockRemoved) -> None:
        if event.medium not in GPU_MEDIA:
            self.counters.other_media += 1
            return
        blocks = self._blocks.get(backend_id)
        if not blocks:
            return
        for engine_hash in event.block_hashes:
            subs = blocks.pop(engine_hash, None)
            if subs is not None:
                self.counters.removed += 1
                self._release(backend_id, subs)
