"""Slow-node demotion must not fire on healthy identical backends (a reported bug: 9-15
demotions in 20 s on four identical fakes, ``tpot_pool 0 ms > 0 ms``, and streams whose
queueing inflated TTFT), yet still demote a really slow one."""

from __future__ import annotations

import random

import pytest

from kiloserve.gateway.resilience.demotion import DemotionConfig, SlowNodeDemoter

IDS = ("a", "b", "c", "d")
POOLS = {b: IDS for b in IDS}


def _demoter(**kw: object) -> SlowNodeDemoter:
    return SlowNodeDemoter(DemotionConfig.model_validate(kw))


def _feed(d: SlowNodeDemoter, now_s: float, ttft_ms: float | None, tpot: dict[str, float]) -> None:
    for _ in range(8):
        for backend, ms in tpot.items():
            d.observe(backend, now_s, ttft_ms, ms)


@pytest.mark.parametrize(
    "tpot",
    [
        {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.04},  # zero median: 0.04 > 2.5 x 0
        {"a": 0.01, "b": 0.02, "c": 0.01, "d": 0.08},  # 4x of nothing
        {"a": 2.0, "b": 2.0, "c": 2.0, "d": 6.0},  # 3x but only 4 ms more per token
    ],
)
def test_near_zero_tpot_differences_never_demote(tpot: dict[str, float]) -> None:
    d = _demoter()
    _feed(d, 0.0, 5.0, tpot)
    assert d.evaluate(0.0, POOLS) == []


def test_the_margin_is_configurable() -> None:
    d = _demoter(min_excess_tpot_ms=0.0)
    _feed(d, 0.0, 5.0, {"a": 2.0, "b": 2.0, "c": 2.0, "d": 6.0})
    assert [(e.backend_id, e.reason) for e in d.evaluate(0.0, POOLS)] == [("d", "tpot_pool")]


def test_queue_inflated_ttft_does_not_demote_a_backend_with_a_normal_tpot() -> None:
    # Identical hardware (same TPOT); "d" got a burst, so its TTFT (queue + prefill) is
    # 4x its peers'. That is load, which routing handles, not a slow node.
    d = _demoter()
    for _ in range(8):
        for backend in IDS:
            d.observe(backend, 0.0, 800.0 if backend == "d" else 200.0, 20.0)
    assert d.evaluate(0.0, POOLS) == []


def test_a_4x_slower_backend_is_still_demoted() -> None:
    d = _demoter()
    _feed(d, 0.0, 100.0, {"a": 8.0, "b": 8.5, "c": 7.5, "d": 32.0})
    events = d.evaluate(0.0, POOLS)
    assert [(e.backend_id, e.reason) for e in events] == [("d", "tpot_pool")]
    # max(2.5 x 8.5, 8.5 + 10): 8.5 is the others' 0.9 quantile (pool_quantile)
    assert events[0].threshold_ms == pytest.approx(21.25)
    assert d.weight_factor("d", 0.0) == pytest.approx(0.2)


def test_recovery_hysteresis_applies_to_the_margin_bound() -> None:
    d = _demoter(window_s=5.0, min_num_samples=3)
    _feed(d, 0.0, 100.0, {"a": 8.0, "b": 8.0, "c": 8.0, "d": 32.0})
    d.evaluate(0.0, POOLS)
    _feed(d, 6.0, 100.0, {"a": 8.0, "b": 8.0, "c": 8.0, "d": 17.0})  # under 20, not 0.8 x 20
    assert d.evaluate(6.0, POOLS) == []
    _feed(d, 12.0, 100.0, {"a": 8.0, "b": 8.0, "c": 8.0, "d": 12.0})
    assert [(e.backend_id, e.reason) for e in d.evaluate(12.0, POOLS)] == [("d", "")]


def test_identical_streaming_backends_are_never_demoted_in_20_s() -> None:
    """The reported run, replayed: four identical fakes behind one gateway for 20 s,
    TPOT ~0 (a fake streams every token at once) and TTFT = prefill + time queued behind
    the backend's own burst (queues vary by the luck of the arrivals), judged every
    100 ms as the gateway's tick does."""
    rng, d = random.Random(7), _demoter()
    events = []
    for tick in range(200):
        now_s = tick * 0.1
        for _ in range(4):
            backend = rng.choice(IDS)
            num_queued = rng.choice((0, 0, 0, 1, 2, 6))
            d.observe(backend, now_s, 5.0 + 15.0 * num_queued + rng.random(), rng.random() / 50)
        events += [e for e in d.evaluate(now_s, POOLS) if e.reason]
    assert events == []


def test_a_stalled_but_healthy_backend_is_judged_against_the_pools_spread() -> None:
    """Under load a chunked long prefill stalls the decodes beside it: a healthy backend
    that just took long documents shows TPOTs above the pool's median but inside its
    spread. The yardstick is the others' upper decile (``pool_quantile`` 0.9), so it is
    not demoted; with the median (0.5) it was."""
    spread = {f"b{i}": 30.0 + 4.0 * i for i in range(10)}  # 30 .. 66 ms
    pools = {b: tuple([*spread, "hot"]) for b in [*spread, "hot"]}
    for q, expected in ((0.9, []), (0.5, [("hot", "tpot_pool")])):
        d = _demoter(pool_quantile=q)
        _feed(d, 0.0, 100.0, {**spread, "hot": 130.0})
        assert [(e.backend_id, e.reason) for e in d.evaluate(0.0, pools)] == expected
