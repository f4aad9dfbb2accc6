"""The twin's KV-cache event log: what its block manager did, as vLLM's KV events.

``KvEventLog`` is the twin's ``block_manager.KvEventSink``. Set as the block
manager's ``kv_sink``, it turns each report into the event vLLM's block pool queues
for the same change (``kvevents.wire``):

* ``stored(seq, begin, end)`` -> ``BlockStored``: the engine hashes of blocks
  ``begin .. end - 1``, the parent (hash of block ``begin - 1``, None for a prompt's
  first block), the blocks' token ids concatenated (prompt ids, then the generated
  ids: ``Sequence.output_token_ids``), ``block_size``, ``medium`` "GPU", no LoRA;
* ``removed(hashes)`` -> one ``BlockRemoved`` with the evicted hashes it had stored;
* ``cleared()`` -> ``AllBlocksCleared``.

``drain()`` hands over the events queued since the last call (the twin publishes
them as one batch per engine step, ``engine.kvpublish``). The engine hashes are the
block manager's own chained hashes (``sequence.chain_block_hash``); a subscriber
re-hashes the token ids its own way (``kvevents.index``), chaining each stored run
from its parent, so it must have seen the parent stored.

Detached blocks: a sequence that computed a block another one had registered first
holds an unregistered copy (its hash is in the index once). If the registered copy
is evicted, the holder's next blocks are registered under a parent hash the index
no longer has: no prefix lookup reaches them until some sequence registers that
parent again. A subscriber would drop such a ``BlockStored`` (unknown parent), and
miss the blocks once they are reachable again. So the log holds such a run back
and emits it (with its descendants) right after the event that stores its parent,
and a ``BlockRemoved`` names only hashes it emitted. The stream then describes
exactly the blocks a lookup can reach: a subscriber's match depth for a prompt
equals the engine's prefix hits (``tests/unit/engine/test_kvlog.py``).
"""

from __future__ import annotations

from kiloserve.engine.sequence import Sequence
from kiloserve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["MEDIUM_GPU", "KvEventLog"]

MEDIUM_GPU = "GPU"


class KvEventLog:
    """Queues a block manager's cache changes as vLLM KV events until ``drain``."""

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[Event] = []
        self._emitted: set[int] = set()  # hashes stored in the stream, not yet removed
        self._held: dict[int, tuple[Sequence, int]] = {}  # detached hash -> (seq, block)
        self._children: dict[int, list[int]] = {}  # parent hash -> held hashes under it

    @property
    def num_pending(self) -> int:
        """Events queued since the last ``drain``."""
        return len(self._events)

    @property
    def num_held_blocks(self) -> int:
        """Registered blocks held back: their parent is not in the stream (detached)."""
        return len(self._held)

    def stored(self, seq: Sequence, begin: int, end: int) -> None:
        if begin > 0 and seq.block_hashes[begin - 1] not in self._emitted:
            self._hold(seq, begin, end)
            return
        self._emit_stored(seq, begin, end)
        self._release(seq.block_hashes[begin:end])

    def removed(self, block_hashes: list[int]) -> None:
        emitted = self._emitted
        gone = [h for h in block_hashes if h in emitted]
        for block_hash in block_hashes:
            if block_hash in emitted:
                emitted.discard(block_hash)
            elif block_hash in self._held:
                self._unhold(block_hash)
        if gone:
            self._events.append(BlockRemoved(tuple(gone), self.medium))

    def cleared(self) -> None:
        self._emitted.clear()
        self._held.clear()
        self._children.clear()
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[Event]:
        """The events queued since the last call, oldest first (the queue empties)."""
        events, self._events = self._events, []
        return events

    def _emit_stored(self, seq: Sequence, begin: int, end: int) -> None:
        size = self.block_size
        hashes = seq.block_hashes[begin:end]
        self._emitted.update(hashes)
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=seq.block_hashes[begin - 1] if begin > 0 else None,
                token_ids=tuple(_token_ids(seq, begin * size, end * size)),
                block_size=size,
                medium=self.medium,
            )
        )

    def _hold(self, seq: Sequence, begin: int, end: int) -> None:
        hashes = seq.block_hashes
        for index in range(begin, end):
            self._held[hashes[index]] = (seq, index)
            self._children.setdefault(hashes[index - 1], []).append(hashes[index])

    def _unhold(self, block_hash: int) -> None:
        seq, index = self._held.pop(block_hash)
        parent = seq.block_hashes[index - 1]
        siblings = self._children[parent]
        siblings.remove(block_hash)
        if not siblings:
            del self._children[parent]

    def _release(self, parents: list[int]) -> None:
        """Emit the held blocks under ``parents`` (now in the stream), depth first;
        consecutive blocks of one sequence go out as one event."""
        stack = list(reversed(parents))
        while stack:
            for child in reversed(self._children.pop(stack.pop(), [])):
                seq, begin = self._held.pop(child)
                end = begin + 1
                hashes = seq.block_hashes
                while end < len(hashes) and self._children.get(hashes[end - 1]) == [hashes[end]]:
                    held = self._held.get(hashes[end])
                    if held is None or held[0] is not seq or held[1] != end:
                        break
                    del self._children[hashes[end - 1]]
                    del self._held[hashes[end]]
                    end += 1
                self._emit_stored(seq, begin, end)
                stack += reversed(hashes[begin:end])


def _token_ids(seq: Sequence, start: int, stop: int) -> list[int]:
    """Token ids ``start .. stop - 1`` of ``seq``'s prompt followed by its output."""
    prompt = seq.prompt_token_ids
    token_ids = prompt[start:stop]
    num_prompt = len(prompt)
    if stop > num_prompt:
        token_ids += seq.output_token_ids[max(0, start - num_prompt) : stop - num_prompt]
    return token_ids
