"""Registry, shared filter and contract tests that hold for every policy."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

import kiloserve.policies as policies
from kiloserve.errors import ConfigError
from kiloserve.policies import (
    BackendState,
    ClusterSnapshot,
    Outcome,
    Policy,
    RequestInfo,
    available_policies,
    create_policy,
)
from kiloserve.policies.defaults import DEFAULT_SCORER_WEIGHTS
from kiloserve.policies.scored import ScoredPolicy

ALL = [
    "canary",
    "cost_aware",
    "default",
    "least_kv",
    "least_request",
    "least_tokens",
    "length_least_conn",
    "power_of_two",
    "prefix_affinity",
    "random",
    "round_robin",
    "scored",
    "seed_weighted",
    "session_affinity",
    "weighted_round_robin",
]
PARAMS: dict[str, dict[str, Any]] = {"canary": {"splits": {"v2": 0.5}}}


def backend(bid: str, **kw: Any) -> BackendState:
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("num_running", 0)
    kw.setdefault("num_waiting", 0)
    kw.setdefault("kv_usage", 0.1)
    return BackendState(backend_id=bid, **kw)


def req(**kw: Any) -> RequestInfo:
    kw.setdefault("input_tokens", 1000)
    kw.setdefault("session_key", "user-1")
    kw.setdefault("prefix_hashes", tuple(range(1, 60)))
    return RequestInfo(request_id="r", model="m", predicted_output_tokens=50, **kw)


def test_available_policies_lists_every_name_sorted() -> None:
    assert available_policies() == ALL


def test_package_all_is_exact() -> None:
    assert sorted(policies.__all__) == sorted(
        [
            "BackendState",
            "ClusterSnapshot",
            "Decision",
            "Outcome",
            "Policy",
            "RequestInfo",
            "available_policies",
            "create_policy",
            "eligible",
        ]
    )
    for name in policies.__all__:
        assert hasattr(policies, name)


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        create_policy("least_conn")
    assert "least_conn" in str(err.value)
    for name in ALL:
        assert name in str(err.value)


def test_unknown_param_is_named() -> None:
    with pytest.raises(ConfigError) as err:
        create_policy("prefix_affinity", {"min_prompt_tokenz": 10})
    assert "min_prompt_tokenz" in str(err.value)
    assert "min_prompt_tokens" in str(err.value)  # the valid ones are listed


def test_no_params_policy_rejects_any_param() -> None:
    with pytest.raises(ConfigError, match="'cursor'"):
        create_policy("round_robin", {"cursor": 3})


@pytest.mark.parametrize(
    ("name", "params", "needle"),
    [
        ("scored", {"scorers": {"qeue": 1.0}}, "qeue"),
        ("scored", {"scorers": {"queue": -1.0}}, "scorers"),
        ("scored", {"scorers": {"queue": 0.0}}, "positive weight"),
        ("scored", {"picker": "min"}, "picker"),
        ("canary", {"splits": {"v2": 0.7, "v3": 0.6}}, "sum"),
        ("canary", {"splits": {"v2": 1.5}}, "v2"),
        ("session_affinity", {"load_factor": 1.0}, "load_factor"),
        ("seed_weighted", {"latency_metric": "itl"}, "latency_metric"),
        ("cost_aware", {"slo_ttft_ms": 0}, "slo_ttft_ms"),
    ],
)
def test_invalid_values_raise_config_error(name: str, params: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        create_policy(name, params)


def test_params_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        create_policy("random", [1, 2])  # type: ignore[arg-type]


def test_default_is_scored_with_default_weights() -> None:
    policy = create_policy("default")
    assert isinstance(policy, ScoredPolicy)
    assert policy.name == "default"
    assert policy.params.scorers == dict(DEFAULT_SCORER_WEIGHTS)
    assert policy.params.picker == "max"
    assert create_policy("scored").name == "scored"


def test_default_params_override_key_by_key() -> None:
    policy = create_policy("default", {"picker": "weighted_random"})
    assert isinstance(policy, ScoredPolicy)
    assert policy.params.picker == "weighted_random"
    assert policy.params.scorers == dict(DEFAULT_SCORER_WEIGHTS)


def test_each_create_is_a_fresh_object() -> None:
    assert create_policy("round_robin") is not create_policy("round_robin")


@pytest.mark.parametrize("name", ALL)
def test_policy_protocol_and_name(name: str) -> None:
    policy = create_policy(name, PARAMS.get(name))
    assert isinstance(policy, Policy)
    assert policy.name == name


@pytest.mark.parametrize("name", ALL)
def test_empty_pool_gives_empty_decision(name: str) -> None:
    policy = create_policy(name, PARAMS.get(name))
    other_model = ClusterSnapshot(0.0, (backend("a", models=frozenset({"x"})),))
    for snapshot in (ClusterSnapshot(0.0, ()), other_model):
        decision = policy.choose(req(), snapshot, random.Random(0))
        assert decision.ranked == ()
        assert decision.backend_id is None
        assert decision.policy == name


@pytest.mark.parametrize("name", ALL)
def test_filter_drops_unhealthy_draining_zero_weight_and_other_models(name: str) -> None:
    snapshot = ClusterSnapshot(
        0.0,
        (
            backend("sick", healthy=False),
            backend("drain", draining=True),
            backend("ejected", effective_weight=0.0),
            backend("off", weight=0.0),
            backend("other", models=frozenset({"other-model"})),
            backend("ok1", in_flight=3, version="v2"),
            backend("ok2", in_flight=3),
        ),
    )
    policy = create_policy(name, PARAMS.get(name))
    rng = random.Random(7)
    for i in range(40):
        decision = policy.choose(req(session_key=f"u{i}"), snapshot, rng)
        assert sorted(decision.ranked) == ["ok1", "ok2"]
        policy.on_dispatch(req(session_key=f"u{i}"), decision.ranked[0])


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_sequence(name: str) -> None:
    snapshot = ClusterSnapshot(
        0.0,
        tuple(
            backend(f"b{i}", in_flight=i % 3, kv_usage=0.1 * (i % 4), group=f"g{i % 2}")
            for i in range(6)
        ),
    )

    def run() -> list[str]:
        policy, rng, out = create_policy(name, PARAMS.get(name)), random.Random(42), []
        for i in range(30):
            r = req(session_key=f"u{i % 5}")
            pick = policy.choose(r, snapshot, rng).ranked[0]
            policy.on_dispatch(r, pick)
            out.append(pick)
        return out

    assert run() == run()


@pytest.mark.parametrize("name", ALL)
def test_choose_does_not_touch_global_random(name: str) -> None:
    snapshot = ClusterSnapshot(0.0, tuple(backend(f"b{i}") for i in range(4)))
    policy = create_policy(name, PARAMS.get(name))
    random.seed(123)
    expected = random.random()
    random.seed(123)
    policy.choose(req(), snapshot, random.Random(1))
    assert random.random() == expected


def _fleet() -> ClusterSnapshot:
    return ClusterSnapshot(
        0.0,
        tuple(
            backend(
                f"b{i}",
                in_flight=i % 3,
                num_running=i,
                kv_usage=0.1 * i,
                ewma_ttft_ms=100.0 + i,
                ewma_tpot_ms=20.0 + i,
                group=f"g{i % 2}",
                version="v2" if i == 0 else "v1",
                scrape_stale=i == 4,
            )
            for i in range(6)
        ),
    )


@pytest.mark.parametrize("name", ALL)
def test_choose_is_pure_and_never_mutates_the_snapshot(name: str) -> None:
    snapshot = _fleet()
    before = [dataclasses.asdict(b) for b in snapshot.backends]
    policy = create_policy(name, PARAMS.get(name))
    policy.on_dispatch(req(), "b2")
    rng = random.Random(5)
    state = rng.getstate()
    first = policy.choose(req(), snapshot, rng)
    rng.setstate(state)
    assert policy.choose(req(), snapshot, rng) == first  # no hidden state moved by choose
    policy.on_complete(req(), "b2", Outcome(ok=True, ttft_ms=10.0))
    assert [dataclasses.asdict(b) for b in snapshot.backends] == before
