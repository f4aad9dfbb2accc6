"""canary: traffic split by version, least load within a version, sticky sessions."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy


def backend(bid: str, version: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    return BackendState(backend_id=bid, version=version, **kw)


def req(session: str | None = None) -> RequestInfo:
    return RequestInfo("r", "m", 100, 10, session_key=session)


FLEET = ClusterSnapshot(
    0.0,
    (
        backend("s1", "v1", in_flight=2),
        backend("s2", "v1", in_flight=1),
        backend("c1", "v2"),
        backend("n1", "v3"),
    ),
)


def test_five_percent_split_over_many_draws() -> None:
    policy, rng = create_policy("canary", {"splits": {"v2": 0.05}}), random.Random(2)
    got = [policy.choose(req(), FLEET, rng).ranked[0] for _ in range(20000)]
    assert got.count("c1") / len(got) == pytest.approx(0.05, abs=0.006)
    # v3 is not in splits, so stable is v1 + v3 and its least loaded backend is n1
    assert set(got) == {"c1", "n1"}


def test_exact_sequence_matches_rng() -> None:
    policy, rng, ref = (
        create_policy("canary", {"splits": {"v2": 0.3}}),
        random.Random(8),
        random.Random(8),
    )
    expected = ["c1" if ref.random() < 0.3 else "n1" for _ in range(50)]
    assert [policy.choose(req(), FLEET, rng).ranked[0] for _ in range(50)] == expected


def test_several_versions_walk_in_name_order() -> None:
    policy = create_policy("canary", {"splits": {"v3": 0.2, "v2": 0.1}})
    rng = random.Random(5)
    got = [policy.choose(req(), FLEET, rng).reason for _ in range(10000)]
    assert got.count("canary v2") / len(got) == pytest.approx(0.1, abs=0.015)
    assert got.count("canary v3") / len(got) == pytest.approx(0.2, abs=0.015)
    assert got.count("stable") / len(got) == pytest.approx(0.7, abs=0.015)


def test_ranked_target_version_first_then_rest_by_load() -> None:
    policy = create_policy("canary", {"splits": {"v1": 1.0}})
    decision = policy.choose(req(), FLEET, random.Random(0))
    assert decision.ranked == ("s2", "s1", "c1", "n1")
    assert decision.reason == "canary v1"


def test_full_ramp_and_missing_version_fallbacks() -> None:
    ramp = create_policy("canary", {"splits": {"v2": 1.0}})
    assert ramp.choose(req(), FLEET, random.Random(0)).ranked[0] == "c1"
    gone = ClusterSnapshot(0.0, (backend("s1", "v1"), backend("c1", "v2", healthy=False)))
    decision = ramp.choose(req(), gone, random.Random(0))
    assert decision.ranked == ("s1",)
    assert decision.reason == "stable"
    only_canary = ClusterSnapshot(0.0, (backend("c1", "v2"),))
    zero = create_policy("canary", {"splits": {"v2": 0.0}})
    assert zero.choose(req(), only_canary, random.Random(0)).ranked == ("c1",)


def test_sticky_sessions_keep_a_user_on_one_version() -> None:
    policy = create_policy("canary", {"splits": {"v2": 0.5}})
    for i in range(50):
        key = f"user-{i}"
        versions = {policy.choose(req(key), FLEET, random.Random(j)).ranked[0] for j in range(5)}
        assert len(versions) == 1
    shares = [policy.choose(req(f"u{i}"), FLEET, random.Random(0)).ranked[0] for i in range(4000)]
    assert shares.count("c1") / len(shares) == pytest.approx(0.5, abs=0.04)


def test_sticky_off_uses_rng_per_request() -> None:
    policy = create_policy("canary", {"splits": {"v2": 0.5}, "sticky_sessions": False})
    got = {policy.choose(req("same-user"), FLEET, random.Random(j)).ranked[0] for j in range(40)}
    assert got == {"c1", "n1"}


def test_stale_backend_is_last_within_its_version() -> None:
    s = ClusterSnapshot(
        0.0,
        (
            backend("s1", "v1", scrape_stale=True),
            backend("s2", "v1", num_running=30),
            backend("c1", "v2"),
        ),
    )
    decision = create_policy("canary", {"splits": {"v2": 0.0}}).choose(req(), s, random.Random(0))
    assert decision.ranked == ("s2", "s1", "c1")
