"""The Router: one decision per request, the pool/health filter, hooks in order, Outcome."""

from __future__ import annotations

import random

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies.base import ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.routing.router import Router, outcome_of
from kiloserve.routing.table import BackendTable


class FixedPolicy:
    """Ranks backends in a fixed order and logs every call."""

    name = "fixed"

    def __init__(self, ranked: tuple[str, ...], log: list[str]) -> None:
        self.ranked = ranked
        self.log = log

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        self.log.append(f"choose:{request.request_id}")
        return Decision(self.ranked, self.name, reason="fixed order")

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        self.log.append(f"policy.dispatch:{backend_id}")

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        self.log.append(f"policy.complete:{backend_id}:{outcome.status}")


def _table() -> BackendTable:
    cfg = parse_gateway_config(
        {
            "backends": [
                {"url": "http://127.0.0.1:9001", "name": "a", "models": ["m"]},
                {"url": "http://127.0.0.1:9002", "name": "b", "models": ["m"]},
                {"url": "http://127.0.0.1:9003", "name": "c", "models": ["m"]},
                {"url": "http://127.0.0.1:9004", "name": "other", "models": ["n"]},
            ]
        }
    )
    return BackendTable(cfg)


def _info(rid: str = "r1") -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", input_tokens=100, predicted_output_tokens=10)


def _router(ranked: tuple[str, ...], log: list[str]) -> Router:
    return Router(_table(), FixedPolicy(ranked, log), random.Random(0))


@pytest.mark.parametrize(
    ("policy_ranked", "draining", "limit", "expected"),
    [
        (("a", "b", "c"), (), None, ("a", "b", "c")),
        (("c", "other", "a"), (), None, ("c", "a")),  # another model's backend dropped
        (("a", "b", "c"), ("b",), None, ("a", "c")),  # not routable: dropped
        (("a", "b", "c"), (), 2, ("a", "b")),  # the simulator asks for retries + 1
        (("zzz", "a"), (), None, ("a",)),  # unknown id dropped
        ((), (), None, ()),
    ],
)
def test_decide_keeps_the_pools_routable_backends_in_order(
    policy_ranked: tuple[str, ...],
    draining: tuple[str, ...],
    limit: int | None,
    expected: tuple[str, ...],
) -> None:
    log: list[str] = []
    router = _router(policy_ranked, log)
    for backend_id in draining:
        router.table.set_draining(backend_id, True)
    decision = router.decide(_info(), 0.0, limit=limit)
    assert decision.ranked == expected
    assert (decision.policy, decision.reason) == ("fixed", "fixed order")
    assert log == ["choose:r1"]  # exactly one choose


def test_admit_hook_and_decision_listeners_see_the_filtered_ranking() -> None:
    log: list[str] = []
    router = _router(("a", "other", "b"), log)
    seen: list[tuple[str, ...]] = []
    router.admit = lambda ranked, pool: (*ranked, "c") if "c" in pool else ranked
    router.decision_listeners.append(lambda info, decision, ranked: seen.append(ranked))
    assert router.decide(_info(), 0.0).ranked == ("a", "b", "c")
    assert seen == [("a", "b", "c")]


def test_no_decision_listener_call_for_an_empty_ranking() -> None:
    router = _router((), [])
    seen: list[object] = []
    router.decision_listeners.append(lambda *args: seen.append(args))
    assert router.decide(_info(), 0.0).ranked == ()
    assert seen == []


def test_hooks_run_table_then_policy_then_listeners() -> None:
    log: list[str] = []
    router = _router(("a",), log)
    router.first_token_listeners.append(lambda b, info, ttft: log.append(f"ft:{b}:{ttft}"))
    router.completion_listeners.append(
        lambda b, info, outcome: log.append(f"listener.complete:{b}:{outcome.output_tokens}")
    )
    info = _info()
    router.dispatch("a", info)
    assert router.table.state("a").in_flight == 1
    router.first_token("a", info, 25.0)
    outcome = router.complete(
        "a", info, ok=True, status=200, started_s=1.0, first_token_s=1.025,
        last_token_s=1.125, output_tokens=5,
    )  # fmt: skip
    assert router.table.state("a").in_flight == 0
    assert log == [
        "policy.dispatch:a",
        "ft:a:25.0",
        "policy.complete:a:200",
        "listener.complete:a:5",
    ]
    assert outcome.ok and outcome.status == 200 and outcome.output_tokens == 5
    assert outcome.ttft_ms == pytest.approx(25.0)
    assert outcome.tpot_ms == pytest.approx(25.0)  # 100 ms over 4 tokens after the first


@pytest.mark.parametrize(
    ("first", "tokens", "ttft_ms", "tpot_ms"),
    [
        (None, 0, None, None),  # no first token (non-streamed, or failed before it)
        (0.5, 1, 500.0, None),  # one token: no inter-token time
        (0.5, 3, 500.0, 250.0),  # (1.0 - 0.5) / 2
    ],
)
def test_outcome_of(
    first: float | None, tokens: int, ttft_ms: float | None, tpot_ms: float | None
) -> None:
    got = outcome_of(True, 200, 0.0, first, 1.0, tokens)
    assert got.ttft_ms == (None if ttft_ms is None else pytest.approx(ttft_ms))
    assert got.tpot_ms == (None if tpot_ms is None else pytest.approx(tpot_ms))
    assert got.output_tokens == tokens
