"""Prefix placements shared by the gateway's workers (``routing.shared_prefixes``).

Two handles on one real shared-memory segment, as workers 0 and 1, each with its own
policy and approximate prefix index: what one worker's index records, the other's
finds after its next pull (before the sharing, worker 1 knew nothing of it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiloserve.policies.prefix_affinity import PrefixAffinityPolicy
from kiloserve.policies.round_robin import RoundRobinPolicy
from kiloserve.routing.shared_load import LoadLayout, SharedLoad
from kiloserve.routing.shared_prefixes import SharedPrefixes

_OPEN: list[SharedLoad] = []


@pytest.fixture
def pair() -> Iterator[tuple[SharedPrefixes, SharedPrefixes]]:
    owner = SharedLoad.create(LoadLayout(workers=2, slots=8, ring=16, prefix_ring=64))
    loads = [SharedLoad.attach(owner.name, i) for i in (0, 1)]
    yield SharedPrefixes(loads[0]), SharedPrefixes(loads[1])
    for load in loads:
        load.close()
    owner.close()


def _hashes(first: int, n: int) -> list[int]:
    return [first + i for i in range(n)]


def test_an_insert_on_one_worker_reaches_the_others_index(
    pair: tuple[SharedPrefixes, SharedPrefixes],
) -> None:
    w0, w1 = pair
    p0, p1 = PrefixAffinityPolicy(), PrefixAffinityPolicy()
    w0.pull(p0)  # binds: worker 0's index publishes its inserts from now on
    w1.pull(p1)
    prompt = _hashes(-(1 << 63), 5)  # the full signed 64-bit range is kept
    p0.index.insert(prompt, "b")
    assert p1.index.match_depths([*prompt, 7]) == {}
    w1.pull(p1)
    assert p1.index.match_depths([*prompt, 7]) == {"b": 5}
    assert w1.num_applied == 1
    # what worker 1 took in is not published again (worker 0 sees nothing new)
    w0.pull(p0)
    assert w0.num_applied == 0


def test_records_wrap_around_the_ring(pair: tuple[SharedPrefixes, SharedPrefixes]) -> None:
    w0, w1 = pair
    p0, p1 = PrefixAffinityPolicy(), PrefixAffinityPolicy()
    w0.pull(p0)
    w1.pull(p1)
    for k in range(20):  # 20 records of 2 + 10 words through a 64-word ring
        prompt = _hashes(1000 * k, 10)
        p0.index.insert(prompt, f"b{k % 3}")
        w1.pull(p1)
        assert p1.index.match_depths(prompt) == {f"b{k % 3}": 10}
    assert w1.num_applied == 20 and w1.num_lost == 0


def test_a_reader_a_whole_ring_behind_skips_and_counts(
    pair: tuple[SharedPrefixes, SharedPrefixes],
) -> None:
    w0, w1 = pair
    p0, p1 = PrefixAffinityPolicy(), PrefixAffinityPolicy()
    w0.pull(p0)
    w1.pull(p1)
    for k in range(10):  # 120 words written, worker 1 asleep
        p0.index.insert(_hashes(1000 * k, 10), "b")
    w1.pull(p1)
    assert w1.num_lost == 1 and w1.num_applied == 0
    p0.index.insert(_hashes(99_000, 10), "c")  # and it follows again from there
    w1.pull(p1)
    assert p1.index.match_depths(_hashes(99_000, 10)) == {"c": 10}


def test_long_prompts_are_cut_to_a_quarter_ring(
    pair: tuple[SharedPrefixes, SharedPrefixes],
) -> None:
    w0, w1 = pair
    p0, p1 = PrefixAffinityPolicy(), PrefixAffinityPolicy()
    w0.pull(p0)
    w1.pull(p1)
    prompt = _hashes(5, 40)
    p0.index.insert(prompt, "b")
    w1.pull(p1)
    assert p1.index.match_depths(prompt) == {"b": 16}  # its first 64 // 4 blocks


def test_a_reloaded_policy_publishes_and_one_without_an_index_is_skipped(
    pair: tuple[SharedPrefixes, SharedPrefixes],
) -> None:
    w0, w1 = pair
    old, new, p1 = PrefixAffinityPolicy(), PrefixAffinityPolicy(), PrefixAffinityPolicy()
    w0.pull(old)
    w0.pull(new)  # a reload swapped worker 0's policy
    assert old.index.listener is None and new.index.listener is not None
    w1.pull(RoundRobinPolicy())  # no index: the siblings' records pass by
    new.index.insert(_hashes(1, 3), "b")
    w1.pull(RoundRobinPolicy())
    w1.pull(p1)
    assert p1.index.match_depths(_hashes(1, 3)) == {}
    new.index.insert(_hashes(50, 3), "c")
    w1.pull(p1)
    assert p1.index.match_depths(_hashes(50, 3)) == {"c": 3}
