"""The identity index's one-loop store (``KvBlockIndex`` with ``IdentityHasher``)
against a plain model of what each backend holds."""

from __future__ import annotations

import random

import pytest

from kiloserve.kvevents.index import IdentityHasher, KvBlockIndex
from kiloserve.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event


@pytest.mark.parametrize("backends", ["ab", "abcde"])
def test_random_stores_removals_and_clears_match_a_plain_model(backends: str) -> None:
    """Two backends, and five (blocks held by three or more: the holder sets that are
    changed in place)."""
    rng = random.Random(7)
    index = KvBlockIndex(16, IdentityHasher())
    held: dict[str, set[int]] = {b: set() for b in backends}
    chains = [[rng.getrandbits(62) for _ in range(40)] for _ in range(6)]
    num_stored = num_removed = 0
    for _ in range(600):
        backend = rng.choice(backends)
        chain = rng.choice(chains)
        begin = rng.randrange(len(chain))
        end = rng.randrange(begin, len(chain)) + 1
        action = rng.random()
        event: Event
        if action < 0.55:
            parent = chain[begin - 1] if begin else None  # held or not: indexed all the same
            event = BlockStored(tuple(chain[begin:end]), parent, (), 16)
            num_stored += end - begin
            held[backend] |= set(chain[begin:end])
        elif action < 0.97:
            event = BlockRemoved(tuple(chain[begin:end]))
            num_removed += len(held[backend] & set(chain[begin:end]))
            held[backend] -= set(chain[begin:end])
        else:
            event = AllBlocksCleared()
            held[backend] = set()
        index.apply(backend, [event])
        for chain_ in chains:
            expected = {}
            for backend_id, blocks in held.items():
                depth = 0
                while depth < len(chain_) and chain_[depth] in blocks:
                    depth += 1
                if depth:
                    expected[backend_id] = depth
            assert index.match_depths(chain_) == expected
        assert index.num_blocks == len(set().union(*held.values()))
        assert index.num_backend_blocks("a") == len(held["a"])
    assert index.counters.stored == num_stored
    assert index.counters.removed == num_removed
    assert index.engine_block_size("a") == 16


def test_an_identity_backend_past_its_budget_is_dropped() -> None:
    index = KvBlockIndex(16, IdentityHasher(), max_blocks_per_backend=3)
    index.apply("a", [BlockStored((1, 2, 3), None, (), 16)])
    index.apply("b", [BlockStored((1, 2), None, (), 16)])
    assert index.match_depths([1, 2, 3]) == {"a": 3, "b": 2}
    index.apply("a", [BlockStored((4,), 3, (), 16)])
    assert index.counters.overflows == 1
    assert index.match_depths([1, 2, 3]) == {"b": 2}
    assert index.num_backend_blocks("a") == 0


def test_blocks_held_by_one_backend_share_its_one_holder_set() -> None:
    index = KvBlockIndex(16, IdentityHasher())
    index.apply("a", [BlockStored((1, 2, 3), None, (), 16)])
    index.apply("b", [BlockStored((1, 2), None, (), 16)])
    holders = index._holders
    assert holders[3] == {"a"} and holders[1] == {"a", "b"}
    only_a = holders[3]
    index.apply("b", [BlockRemoved((1,))])
    assert holders[1] is only_a and holders[2] == {"a", "b"}  # no set made per block
    assert index.match_depths([1, 2, 3]) == {"a": 3}
    index.apply("a", [BlockRemoved((1, 2, 3))])
    assert dict(holders) == {2: {"b"}} and index.match_depths([2]) == {"b": 1}
    index.apply("b", [BlockStored((2,), None, (), 16), AllBlocksCleared()])
    assert index.num_blocks == 0
