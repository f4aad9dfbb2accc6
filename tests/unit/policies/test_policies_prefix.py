"""PrefixIndex and prefix_affinity: longest match, short prompts, imbalance guard."""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import pytest

from kiloserve.errors import ConfigError
from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.prefix_affinity import is_imbalanced
from kiloserve.policies.prefix_index import DEFAULT_MAX_NUM_BLOCKS, PrefixIndex
from kiloserve.tokens import block_hashes, tokenize


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    kw.setdefault("kv_usage", 0.0)
    return BackendState(backend_id=bid, **kw)


def req(hashes: tuple[int, ...], input_tokens: int = 1024) -> RequestInfo:
    return RequestInfo("r", "m", input_tokens, 10, prefix_hashes=hashes)


SYSTEM = tuple(range(100, 140))  # 40 shared blocks
CHAT_A = (*SYSTEM, *range(500, 520))
CHAT_B = (*SYSTEM, *range(900, 930))


# --- index -------------------------------------------------------------------------------


def test_the_default_cap_keeps_the_index_under_28_mib_under_lru_churn() -> None:
    """Issue 15: at 200,000 blocks LRU churn resized the OrderedDict to 2^20 slots (41
    MiB at steady state, 27 MiB when first full); the default cap stays at 2^19."""
    rng = random.Random(0)
    tracemalloc.start()
    try:
        index = PrefixIndex(DEFAULT_MAX_NUM_BLOCKS, max_num_holders_per_block=8)
        inserted = 0
        while inserted < 2 * DEFAULT_MAX_NUM_BLOCKS + 10_000:  # full, then one churn resize
            n = rng.randint(2, 10)
            index.insert([rng.getrandbits(63) for _ in range(n)], f"b{inserted % 3}")
            inserted += n
        size, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.num_blocks == DEFAULT_MAX_NUM_BLOCKS
    assert size < 28 * 2**20, f"{size / 2**20:.1f} MiB"


def test_index_depths_per_backend() -> None:
    index = PrefixIndex(max_num_blocks=1000, max_num_holders_per_block=8)
    index.insert(CHAT_A, "a")
    index.insert(SYSTEM[:10], "b")
    assert index.match_depths(CHAT_A) == {"a": 60, "b": 10}
    assert index.match_depths(CHAT_B) == {"a": 40, "b": 10}
    assert index.match_depths((1, 2, 3)) == {}
    assert index.match_depths(()) == {}


def test_index_with_real_block_hashes() -> None:
    shared = tokenize("the system prompt " * 200)
    first = block_hashes(shared + tokenize(" user one asks a thing" * 20))
    second = block_hashes(shared + tokenize(" user two asks other" * 20))
    index = PrefixIndex(1000, 8)
    index.insert(first, "a")
    depth = index.match_depths(second)["a"]
    assert depth == len(shared) // 16  # the shared full blocks match, nothing after


def test_index_evicts_least_recent_deepest_blocks_first() -> None:
    index = PrefixIndex(max_num_blocks=50, max_num_holders_per_block=8)
    index.insert(CHAT_A, "a")  # 60 blocks > 50: the 10 deepest go
    assert index.num_blocks == 50
    assert index.match_depths(CHAT_A) == {"a": 50}
    index.insert((1, 2, 3, 4, 5), "b")  # 5 more: 5 more of a's deepest go
    assert index.match_depths(CHAT_A) == {"a": 45}
    assert index.match_depths((1, 2, 3, 4, 5)) == {"b": 5}


def test_index_caps_holders_per_block_keeping_most_recent() -> None:
    index = PrefixIndex(max_num_blocks=100, max_num_holders_per_block=2)
    for bid in ("a", "b", "c"):
        index.insert(SYSTEM, bid)
    assert index.match_depths(SYSTEM) == {"b": 40, "c": 40}
    index.insert(SYSTEM, "b")  # refresh b: a stays gone, c is now the oldest
    index.insert(SYSTEM, "a")
    assert index.match_depths(SYSTEM) == {"b": 40, "a": 40}


def test_index_lookups_do_not_change_recency() -> None:
    index = PrefixIndex(max_num_blocks=3, max_num_holders_per_block=4)
    index.insert((1,), "a")
    index.insert((2,), "b")
    index.insert((3,), "c")
    for _ in range(5):
        index.match_depths((1,))
    index.insert((4,), "d")  # evicts block 1, although it was just looked up
    assert index.match_depths((1,)) == {}


def test_index_forget_backend() -> None:
    index = PrefixIndex(100, 8)
    index.insert(SYSTEM, "a")
    index.insert(SYSTEM[:5], "b")
    index.forget_backend("a")
    assert index.match_depths(SYSTEM) == {"b": 5}


def test_index_bounds_validated() -> None:
    with pytest.raises(ConfigError):
        PrefixIndex(0, 1)


# --- policy ------------------------------------------------------------------------------


def dispatch(policy: Any, r: RequestInfo, bid: str) -> None:
    policy.on_dispatch(r, bid)


def test_routes_to_the_longest_match() -> None:
    s = ClusterSnapshot(0.0, (backend("a"), backend("b", in_flight=3), backend("c", in_flight=1)))
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(CHAT_A), "c")
    dispatch(policy, req(SYSTEM), "b")
    decision = policy.choose(req(CHAT_A), s, random.Random(0))
    assert decision.ranked == ("c", "a", "b")
    assert decision.reason == "prefix"
    # another chat sharing only the system prompt: tie b/c at 40 blocks, c less loaded
    assert policy.choose(req(CHAT_B), s, random.Random(0)).ranked[0] == "c"


def test_equal_match_and_equal_load_goes_to_snapshot_order() -> None:
    s = ClusterSnapshot(0.0, (backend("a"), backend("b", in_flight=1), backend("c", in_flight=1)))
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(SYSTEM), "c")
    dispatch(policy, req(SYSTEM), "b")
    assert policy.choose(req(SYSTEM), s, random.Random(0)).ranked[0] == "b"


@pytest.mark.parametrize(
    ("r", "reason"),
    [
        (req(CHAT_A, input_tokens=511), "short prompt"),
        (req((), input_tokens=4000), "short prompt"),
        (req((7, 8, 9)), "no prefix match"),
    ],
)
def test_least_load_when_affinity_does_not_apply(r: RequestInfo, reason: str) -> None:
    s = ClusterSnapshot(0.0, (backend("a", in_flight=2), backend("b", in_flight=1)))
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(CHAT_A), "a")
    decision = policy.choose(r, s, random.Random(0))
    assert decision.ranked == ("b", "a")
    assert decision.reason == reason


def test_imbalance_guard_falls_back_to_least_load() -> None:
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(CHAT_A), "a")
    # 40 vs 5: diff 35 > 32 and 40 > 5 * 1.5 -> guard trips
    hot = ClusterSnapshot(0.0, (backend("a", num_running=40), backend("b", num_running=5)))
    assert policy.choose(req(CHAT_A), hot, random.Random(0)).reason == "imbalanced"
    assert policy.choose(req(CHAT_A), hot, random.Random(0)).ranked[0] == "b"
    # 100 vs 70: diff 30 <= 32 -> affinity holds
    ok = ClusterSnapshot(0.0, (backend("a", num_running=100), backend("b", num_running=70)))
    assert policy.choose(req(CHAT_A), ok, random.Random(0)).ranked[0] == "a"


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([40.0, 5.0], True),
        ([37.0, 5.0], False),  # diff 32 is not > 32
        ([100.0, 67.0], False),  # diff 33 > 32, but 100 > 67 * 1.5 = 100.5 fails
        ([101.0, 67.0], True),
        ([40.0, 5.0 + 1e9], True),  # unknown scraped load: its in-flight load counts
        ([30.0, 5.0 + 1e9], False),
        ([50.0], False),
    ],
)
def test_is_imbalanced_table(loads: list[float], expected: bool) -> None:
    assert is_imbalanced(loads, 32.0, 1.5) is expected


def test_unknown_scraped_load_keeps_affinity_on_in_flight_load() -> None:
    """Issue 14: without engine metrics prefix_affinity gave up its prefixes (hit 0.31):
    an unknown scraped load counted as saturated. It counts as the in-flight load now."""
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(CHAT_A), "a")
    s = ClusterSnapshot(
        0.0, (backend("a", scrape_stale=True, in_flight=2), backend("b", scrape_stale=True))
    )
    decision = policy.choose(req(CHAT_A), s, random.Random(0))
    assert decision.reason == "prefix"
    assert decision.ranked == ("a", "b")
    # ... and the guard still works on in-flight loads alone
    hot = ClusterSnapshot(
        0.0, (backend("a", scrape_stale=True, in_flight=40), backend("b", scrape_stale=True))
    )
    assert policy.choose(req(CHAT_A), hot, random.Random(0)).reason == "imbalanced"


def test_effective_weight_scales_guard_load() -> None:
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(CHAT_A), "a")
    # 10 requests at weight 0.2 = load 50 vs 5: guard trips
    s = ClusterSnapshot(
        0.0, (backend("a", num_running=10, effective_weight=0.2), backend("b", num_running=5))
    )
    assert policy.choose(req(CHAT_A), s, random.Random(0)).ranked[0] == "b"


def test_min_match_fraction() -> None:
    policy = create_policy("prefix_affinity", {"min_match_fraction": 0.8})
    dispatch(policy, req(SYSTEM), "a")
    s = ClusterSnapshot(0.0, (backend("a", in_flight=1), backend("b")))
    assert policy.choose(req(CHAT_B), s, random.Random(0)).reason == "no prefix match"  # 40/70
    assert policy.choose(req(SYSTEM), s, random.Random(0)).ranked[0] == "a"


def test_affinity_target_must_be_a_candidate() -> None:
    policy = create_policy("prefix_affinity")
    dispatch(policy, req(CHAT_A), "a")
    s = ClusterSnapshot(0.0, (backend("a", healthy=False), backend("b"), backend("c")))
    assert policy.choose(req(CHAT_A), s, random.Random(0)).ranked == ("b", "c")


def test_index_single_and_shared_holders_and_substring_ids() -> None:
    """One holder is stored as the id itself: ids that are substrings of each other
    must not match ("b1" is not "b10")."""
    index = PrefixIndex(100, 8)
    index.insert([1, 2, 3], "b10")
    assert index.match_depths([1, 2, 3]) == {"b10": 3}
    index.insert([1, 2], "b1")
    assert index.match_depths([1, 2, 3]) == {"b10": 3, "b1": 2}
    index.forget_backend("b10")
    assert index.match_depths([1, 2, 3]) == {"b1": 2}
    index.forget_backend("b1")
    assert index.num_blocks == 0
    one = PrefixIndex(100, 1)  # one holder per block: the most recent wins
    one.insert([1], "a")
    one.insert([1], "b")
    assert one.match_depths([1]) == {"b": 1}


def test_index_finds_a_deep_holder_dropped_from_a_shared_first_block() -> None:
    """Every Mooncake prompt starts with one block: its holder list keeps only the 8
    most recent backends, and a conversation's backend must still be found (issue 14:
    prefix_affinity without events fell to a 0.06 hit rate on the trace)."""
    index = PrefixIndex(10_000, 8)
    conversation = [0, *range(100, 140)]  # the shared first block, then its own
    index.insert(conversation, "b0")
    for i in range(1, 10):  # nine other backends receive the shared block only
        index.insert([0, 1000 + i], f"b{i}")
    depths = index.match_depths([*conversation, 999])
    assert depths["b0"] == len(conversation)
