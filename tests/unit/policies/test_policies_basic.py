"""round_robin, random, least_request, least_tokens, power_of_two, least_kv:
exact choice sequences on hand-built snapshots."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    kw.setdefault("kv_usage", 0.0)
    return BackendState(backend_id=bid, **kw)


def snap(*backends: BackendState) -> ClusterSnapshot:
    return ClusterSnapshot(now_s=0.0, backends=backends)


def req(model: str = "m", input_tokens: int = 100, output_tokens: int = 10) -> RequestInfo:
    return RequestInfo("r", model, input_tokens, output_tokens)


def picks(name: str, snapshot: ClusterSnapshot, n: int, seed: int = 0) -> list[str]:
    policy, rng, out = create_policy(name), random.Random(seed), []
    for _ in range(n):
        pick = policy.choose(req(), snapshot, rng).ranked[0]
        policy.on_dispatch(req(), pick)
        out.append(pick)
    return out


# --- round robin ---------------------------------------------------------------------


def test_round_robin_cycles_in_snapshot_order_with_rotated_fallbacks() -> None:
    s = snap(backend("a"), backend("b", in_flight=50), backend("c"))
    assert picks("round_robin", s, 7) == ["a", "b", "c", "a", "b", "c", "a"]
    policy = create_policy("round_robin")
    policy.on_dispatch(req(), "a")
    assert policy.choose(req(), s, random.Random(0)).ranked == ("b", "c", "a")


def test_round_robin_cursor_moves_only_in_on_dispatch() -> None:
    s = snap(backend("a"), backend("b"))
    policy = create_policy("round_robin")
    rng = random.Random(0)
    assert [policy.choose(req(), s, rng).ranked[0] for _ in range(3)] == ["a", "a", "a"]


def test_round_robin_keeps_one_cursor_per_model() -> None:
    s = snap(
        backend("a"),
        backend("b"),
        backend("x", models=frozenset({"n"})),
        backend("y", models=frozenset({"n"})),
    )
    policy, rng = create_policy("round_robin"), random.Random(0)
    seq = []
    for model in ["m", "m", "n", "m", "n"]:
        pick = policy.choose(req(model), s, rng).ranked[0]
        policy.on_dispatch(req(model), pick)
        seq.append(pick)
    assert seq == ["a", "b", "x", "a", "y"]


# --- random ----------------------------------------------------------------------------


def test_random_matches_rng_randrange_exactly() -> None:
    s = snap(backend("a"), backend("b"), backend("c"), backend("d", healthy=False))
    ref = random.Random(5)
    expected = [["a", "b", "c"][ref.randrange(3)] for _ in range(20)]
    assert picks("random", s, 20, seed=5) == expected
    decision = create_policy("random").choose(req(), s, random.Random(5))
    assert sorted(decision.ranked) == ["a", "b", "c"]


def test_random_is_roughly_uniform() -> None:
    s = snap(backend("a"), backend("b"), backend("c"))
    got = picks("random", s, 3000, seed=1)
    for bid in "abc":
        assert 900 < got.count(bid) < 1100


# --- least request ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "ranked"),
    [
        # fewest in-flight wins
        ([backend("a", in_flight=3), backend("b", in_flight=1), backend("c", in_flight=2)], "bca"),
        # tie on in-flight: scraped running+waiting decides
        (
            [backend("a", in_flight=1, num_running=5), backend("b", in_flight=1, num_running=2)],
            "ba",
        ),
        # full tie: snapshot order
        ([backend("a", in_flight=1), backend("b", in_flight=1), backend("c", in_flight=1)], "abc"),
        # stale scrape is saturated in the tie-break, never idle
        (
            [
                backend("a", in_flight=1, scrape_stale=True),
                backend("b", in_flight=1, num_running=9),
            ],
            "ba",
        ),
        (
            [
                backend("a", in_flight=1, num_running=None),
                backend("b", in_flight=1, num_waiting=30),
            ],
            "ba",
        ),
        # effective weight 0.25 makes 1 in-flight count as 4
        ([backend("a", in_flight=1, effective_weight=0.25), backend("b", in_flight=3)], "ba"),
    ],
)
def test_least_request_order(backends: list[BackendState], ranked: str) -> None:
    decision = create_policy("least_request").choose(req(), snap(*backends), random.Random(0))
    assert decision.ranked == tuple(ranked)


# --- least tokens ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "ranked"),
    [
        (
            [
                backend("a", outstanding_prefill_tokens=500, outstanding_decode_tokens=600),
                backend("b", outstanding_decode_tokens=900),
                backend("c", outstanding_prefill_tokens=1000),
            ],
            "bca",
        ),
        # equal tokens: known lower load first, stale last
        (
            [
                backend("a", outstanding_decode_tokens=10, scrape_stale=True),
                backend("b", outstanding_decode_tokens=10, num_running=3),
                backend("c", outstanding_decode_tokens=10, num_running=1),
            ],
            "cba",
        ),
        # demoted backend: (100 + 110) / 0.5 = 420 > 300 + 110
        (
            [
                backend("a", outstanding_decode_tokens=100, effective_weight=0.5),
                backend("b", outstanding_decode_tokens=300),
            ],
            "ba",
        ),
    ],
)
def test_least_tokens_order(backends: list[BackendState], ranked: str) -> None:
    decision = create_policy("least_tokens").choose(req(), snap(*backends), random.Random(0))
    assert decision.ranked == tuple(ranked)


# --- power of two ---------------------------------------------------------------------


def test_power_of_two_exact_sequence_against_reference() -> None:
    loads = [5, 0, 3, 1, 4]
    s = snap(*[backend(f"b{i}", in_flight=x) for i, x in enumerate(loads)])
    ref, expected = random.Random(11), []
    for _ in range(25):
        i = ref.randrange(5)
        j = ref.randrange(4)
        j = j + 1 if j >= i else j
        expected.append(f"b{i}" if loads[i] <= loads[j] else f"b{j}")
    assert picks("power_of_two", s, 25, seed=11) == expected


def test_power_of_two_never_picks_the_most_loaded() -> None:
    s = snap(backend("a", in_flight=1), backend("b", in_flight=9), backend("c", in_flight=2))
    got = picks("power_of_two", s, 300, seed=3)
    assert "b" not in got
    assert got.count("a") > got.count("c")


def test_power_of_two_ranks_winner_loser_then_rest() -> None:
    loads = {"a": 2, "b": 1, "c": 0, "d": 0}
    s = snap(*[backend(bid, in_flight=x) for bid, x in loads.items()])
    policy, rng, ref = create_policy("power_of_two"), random.Random(4), random.Random(4)
    for _ in range(10):
        i = ref.randrange(4)
        j = ref.randrange(3)
        j = j + 1 if j >= i else j
        ids = list(loads)
        a, b = ids[i], ids[j]
        winner, loser = (b, a) if loads[b] < loads[a] else (a, b)
        rest = tuple(x for x in ids if x not in (a, b))
        assert policy.choose(req(), s, rng).ranked == (winner, loser, *rest)
    one = snap(backend("only"))
    before = rng.getstate()
    assert policy.choose(req(), one, rng).ranked == ("only",)
    assert rng.getstate() == before  # one candidate: no draw


def test_power_of_two_stale_loses_to_known() -> None:
    s = snap(backend("stale", scrape_stale=True), backend("busy", in_flight=20))
    assert set(picks("power_of_two", s, 20)) == {"busy"}


# --- least kv --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "ranked"),
    [
        (
            [backend("a", kv_usage=0.7), backend("b", kv_usage=0.2), backend("c", kv_usage=0.5)],
            "bca",
        ),
        # unknown kv counts as full, stale too, even if the stale value looked empty
        (
            [
                backend("a", kv_usage=None),
                backend("b", kv_usage=0.0, scrape_stale=True),
                backend("c", kv_usage=0.95),
            ],
            "cab",
        ),
        # equal free: lower request load first
        ([backend("a", kv_usage=0.5, in_flight=4), backend("b", kv_usage=0.5, in_flight=2)], "ba"),
        # demoted: 0.8 free * 0.2 = 0.16 < 0.3 free
        ([backend("a", kv_usage=0.2, effective_weight=0.2), backend("b", kv_usage=0.7)], "ba"),
    ],
)
def test_least_kv_order(backends: list[BackendState], ranked: str) -> None:
    decision = create_policy("least_kv").choose(req(), snap(*backends), random.Random(0))
    assert decision.ranked == tuple(ranked)
