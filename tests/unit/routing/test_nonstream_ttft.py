"""Non-streamed successes teach the learned prefill speed: their TTFT is estimated at
completion as E2E minus the decode of the tokens after the first at the backend's EWMA
TPOT (``accounting.estimated_ttft_ms``). Before, only streams taught it."""

from __future__ import annotations

import random

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies import create_policy
from kiloserve.policies.accounting import estimated_ttft_ms, prefill_ms_per_token
from kiloserve.policies.base import BackendState, Outcome, RequestInfo
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable


@pytest.mark.parametrize(
    ("tpot_ms", "e2e_ms", "output_tokens", "expected"),
    [
        (10.0, 500.0, 31, 200.0),  # 500 - 30 x 10
        (10.0, 50.0, 1, 50.0),  # one token: all of it is the first
        (None, 500.0, 31, None),  # TPOT unknown: no sample
        (10.0, 250.0, 31, None),  # decoded faster than usual: split unknown
        (10.0, 300.0, 31, None),  # nothing left for the prefill
        (10.0, 500.0, 0, None),  # no token at all
    ],
)
def test_estimated_ttft(
    tpot_ms: float | None, e2e_ms: float, output_tokens: int, expected: float | None
) -> None:
    s = BackendState("b", ewma_tpot_ms=tpot_ms)
    assert estimated_ttft_ms(s, e2e_ms, output_tokens) == expected


def _router() -> tuple[Router, list[str]]:
    cfg = parse_gateway_config(
        {"backends": [{"url": "http://127.0.0.1:9001", "name": "a", "models": ["m"]}]}
    )
    router = Router(BackendTable(cfg), create_policy("least_request"), random.Random(0))
    heard: list[str] = []
    router.first_token_listeners.append(lambda b, i, ms: heard.append(f"first:{ms}"))
    router.completion_listeners.append(lambda b, i, o: heard.append(f"done:{o.ttft_ms}"))
    return router, heard


def _info(rid: str) -> RequestInfo:
    return RequestInfo(rid, "m", input_tokens=400, predicted_output_tokens=31)


def _finish(
    router: Router, rid: str, *, stream: bool, ok: bool = True, end_s: float = 1.5
) -> Outcome:
    info = _info(rid)
    router.dispatch("a", info)
    first_s = 1.1 if stream else None
    if stream:
        router.first_token("a", info, 100.0)
    return router.complete(
        "a", info, ok=ok, status=200 if ok else 500, started_s=1.0,
        first_token_s=first_s, last_token_s=end_s, output_tokens=31,
    )  # fmt: skip


def test_a_non_streamed_success_teaches_the_prefill_speed() -> None:
    router, heard = _router()
    state = router.table.state("a")
    _finish(router, "s", stream=True)  # TTFT 100 ms, TPOT (1.5 - 1.1) / 30 s
    assert state.ewma_tpot_ms == pytest.approx(400.0 / 30)
    heard.clear()
    outcome = _finish(router, "n", stream=False, end_s=1.7)  # TTFT ~ 700 - 400 = 300 ms
    assert state.ewma_ttft_ms == pytest.approx(100.0 + 0.2 * (300.0 - 100.0))
    assert state.num_ttft_samples == 2
    assert prefill_ms_per_token(state) is None  # used from MIN_TTFT_SAMPLES (3) samples on
    state.num_ttft_samples = 3
    assert prefill_ms_per_token(state) == pytest.approx(140.0 / 400.0)
    assert outcome.ttft_ms is None  # the Outcome keeps what was measured
    assert heard == ["done:None"]  # an estimate is no first token: no listener hears one


def test_non_streamed_requests_alone_teach_nothing_without_a_tpot() -> None:
    router, _ = _router()
    _finish(router, "n1", stream=False, end_s=1.7)
    assert router.table.state("a").ewma_ttft_ms is None


def test_a_failed_non_streamed_request_teaches_nothing() -> None:
    router, _ = _router()
    _finish(router, "s", stream=True)
    _finish(router, "n", stream=False, ok=False, end_s=1.7)
    assert router.table.state("a").ewma_ttft_ms == pytest.approx(100.0)  # the stream's only


def test_prefill_work_is_released_once() -> None:
    router, _ = _router()
    state = router.table.state("a")
    _finish(router, "s", stream=True)
    info = _info("n")
    router.dispatch("a", info)
    router.dispatch("a", _info("other"))  # still queued: its 400 tokens stay
    assert state.outstanding_prefill_tokens == 800
    router.complete(
        "a", info, ok=True, status=200, started_s=1.0, first_token_s=None,
        last_token_s=1.5, output_tokens=31,
    )  # fmt: skip
    assert state.outstanding_prefill_tokens == 400
    assert state.in_flight == 1
