"""The P/D split rule, the decode chooser and role-aware decisions (routing/disagg.py)."""

from __future__ import annotations

import random

import pytest

from kiloserve.errors import ConfigError
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.migrate import Delivered, continuation_body
from kiloserve.policies.base import BackendState, ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.round_robin import RoundRobinPolicy
from kiloserve.routing.disagg import (
    DisaggConfig,
    rank_decode,
    role_pools,
    should_split,
    unsplit_order,
)
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable


def _state(name: str, role: str, **kw: object) -> BackendState:
    return BackendState(backend_id=name, models=frozenset({"m"}), role=role, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("roles", "unhealthy", "input_tokens", "expected"),
    [
        (("prefill", "decode"), (), 10, True),  # no both backend: every prompt splits
        (("prefill", "decode", "both"), (), 10, False),  # short: the both backend
        (("prefill", "decode", "both"), (), 1023, False),
        (("prefill", "decode", "both"), (), 1024, True),  # at the threshold: split
        (("prefill", "decode", "both"), ("both",), 10, True),  # both unhealthy: split
        (("prefill", "decode"), ("prefill",), 5000, False),  # no healthy prefill
        (("prefill", "decode"), ("decode",), 5000, False),  # no healthy decode
        (("both",), (), 5000, False),
        (("decode", "both"), (), 5000, False),
    ],
)
def test_should_split(
    roles: tuple[str, ...], unhealthy: tuple[str, ...], input_tokens: int, expected: bool
) -> None:
    pool = [_state(f"{r}0", r, healthy=r not in unhealthy) for r in roles]
    assert should_split(role_pools(pool), input_tokens, DisaggConfig()) is expected


def test_should_split_off_and_threshold() -> None:
    pools = role_pools([_state("p", "prefill"), _state("d", "decode"), _state("b", "both")])
    assert not should_split(pools, 10**6, DisaggConfig(enabled=False))
    assert should_split(pools, 0, DisaggConfig(min_prompt_tokens=0))
    assert not should_split(pools, 99, DisaggConfig(min_prompt_tokens=100))


def test_role_pools_keep_routable_only() -> None:
    pool = [
        _state("p0", "prefill", draining=True),
        _state("p1", "prefill"),
        _state("d0", "decode", weight=0.0),
        _state("d1", "decode", effective_weight=0.0),
        _state("b0", "both"),
    ]
    pools = role_pools(pool)
    assert [b.backend_id for b in pools.prefill] == ["p1"]
    assert pools.decode == ()
    assert [b.backend_id for b in pools.both] == ["b0"]
    assert not pools.can_split


def test_rank_decode_least_kv_then_in_flight() -> None:
    decode = [
        _state("d0", "decode", kv_usage=0.5, in_flight=0),
        _state("d1", "decode", kv_usage=0.2, in_flight=9),
        _state("d2", "decode", kv_usage=0.2, in_flight=3),
        _state("d3", "decode", kv_usage=None, in_flight=0),  # unknown reads as full
        _state("d4", "decode", kv_usage=0.0, in_flight=0, scrape_stale=True),  # stale too
        _state("d5", "decode", kv_usage=0.5, in_flight=0),  # tie: pool order
    ]
    assert rank_decode(decode) == ("d2", "d1", "d0", "d5", "d3", "d4")


def test_unsplit_order_is_stable() -> None:
    roles = {"p0": "prefill", "d0": "decode", "b0": "both", "p1": "prefill", "b1": "both"}
    ranked = ("p0", "d0", "b0", "p1", "b1")
    assert unsplit_order(ranked, roles.__getitem__) == ("b0", "b1", "d0", "p0", "p1")


def test_backend_role_is_validated() -> None:
    cfg = parse_gateway_config({"backends": [{"url": "http://h:1", "role": "prefill"}]})
    assert cfg.backends[0].role == "prefill"
    assert parse_gateway_config({"backends": [{"url": "http://h:1"}]}).backends[0].role == "both"
    with pytest.raises(ConfigError, match="role"):
        parse_gateway_config({"backends": [{"url": "http://h:1", "role": "prefil"}]})
    with pytest.raises(ConfigError, match="min_prompt_tokenz"):
        parse_gateway_config({"disagg": {"min_prompt_tokenz": 1}})


def _table(roles: dict[str, str]) -> BackendTable:
    backends = [
        {"url": f"http://127.0.0.1:{9000 + i}", "name": name, "models": ["m"], "role": role}
        for i, (name, role) in enumerate(roles.items())
    ]
    return BackendTable(parse_gateway_config({"backends": backends}))


def _info(rid: str = "r") -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", input_tokens=100, predicted_output_tokens=10)


class _Recording:
    """Ranks every candidate it is shown, in snapshot order, and keeps what it saw."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        known = snapshot.eligible_by_model
        pool = known[request.model] if known is not None else snapshot.pool(request.model)
        ids = tuple(b.backend_id for b in pool)
        self.seen.append(ids)
        return Decision(ids, self.name)

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        return None

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        return None


def test_decide_orders_unsplit_traffic_both_first() -> None:
    table = _table({"p0": "prefill", "d0": "decode", "b0": "both", "d1": "decode"})
    policy = _Recording()
    router = Router(table, policy, random.Random(0))
    assert router.decide(_info(), 0.0).ranked == ("b0", "d0", "d1", "p0")
    assert router.decide(_info(), 0.0, limit=2).ranked == ("b0", "d0")  # order, then limit


def test_decide_with_role_shows_the_policy_that_role_only() -> None:
    table = _table({"p0": "prefill", "d0": "decode", "p1": "prefill", "b0": "both"})
    policy = _Recording()
    router = Router(table, policy, random.Random(0))
    assert router.decide(_info(), 0.0, role="prefill").ranked == ("p0", "p1")
    assert policy.seen[-1] == ("p0", "p1")
    table.set_draining("p0", True)
    assert router.decide(_info(), 0.0, role="prefill").ranked == ("p1",)
    # a caller's precomputed candidates (the simulator's) are restricted too
    every = {"m": table.pool("m")}
    assert router.decide(_info(), 0.0, eligible_by_model=every, role="decode").ranked == ("d0",)


def test_decide_with_role_round_robin_rotates_over_that_role() -> None:
    table = _table({"p0": "prefill", "d0": "decode", "p1": "prefill", "b0": "both"})
    policy = RoundRobinPolicy()
    router = Router(table, policy, random.Random(0))
    firsts = []
    for i in range(4):
        decision = router.decide(_info(f"r{i}"), 0.0, role="prefill")
        firsts.append(decision.ranked[0])
        router.dispatch(decision.ranked[0], _info(f"r{i}"))
    assert firsts == ["p0", "p1", "p0", "p1"]


def test_round_robin_rotates_prefill_legs_when_decode_legs_are_dispatched_too() -> None:
    """A split request dispatches two legs: the model's cursor moved twice per request,
    so with two prefill backends every prefill leg went to p0 (a gateway in front of
    twins showed it)."""
    table = _table({"p0": "prefill", "d0": "decode", "p1": "prefill"})
    router = Router(table, RoundRobinPolicy(), random.Random(0))
    firsts = []
    for i in range(4):
        decision = router.decide(_info(f"r{i}"), 0.0, role="prefill")
        firsts.append(decision.ranked[0])
        router.dispatch(decision.ranked[0], _info(f"r{i}"))  # the prefill leg
        router.dispatch("d0", _info(f"r{i}"))  # the decode leg (ranked by rank_decode)
    assert firsts == ["p0", "p1", "p0", "p1"]


def test_table_without_roles_keeps_the_policy_order() -> None:
    table = _table({"a": "both", "b": "both"})
    assert not table.has_roles
    router = Router(table, _Recording(), random.Random(0))
    assert router.decide(_info(), 0.0).ranked == ("a", "b")


def test_table_describes_and_updates_roles() -> None:
    table = _table({"p0": "prefill", "b0": "both"})
    assert table.has_roles
    rows = {row["name"]: row for row in table.describe(0.0)}
    assert rows["p0"]["role"] == "prefill" and rows["b0"]["role"] == "both"
    cfg = parse_gateway_config({"backends": [{"url": "http://127.0.0.1:9000", "name": "p0"}]})
    table.add_backend(cfg.backends[0].model_copy(update={"models": ["m"]}))
    assert table.role_of("p0") == "both" and not table.has_roles


def test_continuation_drops_kv_transfer_params() -> None:
    body = {
        "model": "m",
        "prompt": "abc",
        "max_tokens": 9,
        "stream": True,
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    out = continuation_body("/v1/completions", body, Delivered(text="de", num_tokens=2))
    assert out is not None
    assert "kv_transfer_params" not in out
    assert out["prompt"] == "abcde" and out["max_tokens"] == 7
