"""The ``ttft`` scorer's prior for a young backend's prefill speed (issue 14).

A backend whose hardware group has no learned prefill speed yet (fewer than
``MIN_TTFT_SAMPLES`` first tokens on every backend of its GPU type and TP degree)
takes a learned group's speed scaled by the ratio of the two replicas' prefill
capability (the catalog's dense BF16 TFLOPS x prefill MFU x TP), not the pool's
median: at start-up the A100s no longer look as fast as the H100s.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kiloserve.catalog import get_gpu
from kiloserve.policies import BackendState, RequestInfo
from kiloserve.policies.scorers import SCORERS, ScoringContext
from kiloserve.routing.table import prefill_capability

H100 = 989.0 * 0.45  # catalog H100-SXM: dense BF16 TFLOPS x prefill MFU
A100 = 312.0 * 0.60  # catalog A100-80G
L40S_TFLOPS = get_gpu("L40S").prefill_tflops


def learned(bid: str, gpu: str, cap: float | None, ms_per_token: float) -> BackendState:
    """An idle backend with ``MIN_TTFT_SAMPLES`` first tokens at ``ms_per_token``."""
    return backend(
        bid, gpu, cap, ewma_ttft_ms=ms_per_token * 1000.0, ewma_prefill_work_tokens=1000.0,
        num_ttft_samples=3,
    )  # fmt: skip


def backend(bid: str, gpu: str, cap: float | None, **kw: Any) -> BackendState:
    kw.setdefault("num_ttft_samples", 0)
    return BackendState(
        backend_id=bid, models=frozenset({"m"}), gpu=gpu, prefill_capability=cap,
        num_running=0, num_waiting=0, kv_usage=0.0, **kw,
    )  # fmt: skip


def ttft(pool: list[BackendState], input_tokens: int = 1000) -> list[float]:
    info = RequestInfo("r", "m", input_tokens=input_tokens, predicted_output_tokens=10)
    return SCORERS["ttft"](ScoringContext(request=info, pool=pool))


def test_the_table_reads_capability_from_the_catalog() -> None:
    assert prefill_capability("H100") == pytest.approx(H100)
    assert prefill_capability("H100-SXM", tp=4) == pytest.approx(4 * H100)
    assert prefill_capability("a100_80g", tp=2) == pytest.approx(2 * A100)
    assert prefill_capability("") is None
    assert prefill_capability("-") is None  # a real engine's unnamed GPU
    assert prefill_capability("TPU-v9") is None


def test_young_a100s_take_the_catalog_ratio_not_the_h100_median() -> None:
    """Two learned H100s (0.05 and 0.07 ms/token: median 0.07), two young A100s. The
    A100s predict 0.07 x H100 / A100 = 0.166 ms/token (the old code: the pool median,
    0.07, so every idle backend scored 1 and long prompts went to the A100s too)."""
    pool = [
        learned("h1", "H100-SXM", H100, 0.05),
        learned("h2", "H100-SXM", H100, 0.07),
        learned("a1", "A100-80G", A100, 0.9),
        backend("a2", "A100-80G", A100),
    ]
    pool[2].num_ttft_samples = 2  # two first tokens: still young
    a100_speed = 0.07 * H100 / A100
    assert a100_speed == pytest.approx(0.1664, abs=1e-4)
    # every backend idle: pred = speed x 1000 tokens; the group median (0.07) for both H100s
    assert ttft(pool) == pytest.approx([1.0, 1.0, 0.07 / a100_speed, 0.07 / a100_speed])
    assert ttft(pool)[2] == pytest.approx(A100 / H100)  # 0.42
    # an H100 with 1,300 prompt tokens queued still beats an idle A100 for 1,000 more
    # (0.07 x 2300 = 161 ms against 166 ms); the idle h2 is best (70 ms)
    pool[0].outstanding_prefill_tokens = 1300
    scores = ttft(pool)
    assert scores[0] == pytest.approx(1000 / 2300)
    assert scores[0] > scores[2]
    # once an A100 has learned (3 samples), the group's own median replaces the prior
    pool[2].num_ttft_samples = 3  # 0.9 ms/token: the median of the one learned A100
    assert ttft(pool)[2] == pytest.approx(0.07 / 0.9)
    assert ttft(pool)[3] == pytest.approx(0.07 / 0.9)


def test_no_catalog_entry_keeps_the_pool_median() -> None:
    """Without a capability (no GPU named, or one the catalog does not know) a young
    backend takes the median of the learned speeds, as before the prior."""
    pool = [
        learned("h1", "H100-SXM", H100, 0.05),
        learned("h2", "H100-SXM", H100, 0.07),
        learned("x1", "TPU-v9", None, 0.30),
        backend("x2", "TPU-v9-lite", None),
        backend("u1", "", None),
    ]
    # learned speeds: 0.07, 0.07, 0.30 -> median 0.07 for both unknowns
    assert ttft(pool) == pytest.approx([1.0, 1.0, 0.07 / 0.30, 1.0, 1.0])
    # a learned group without a capability gives no prior: the A100 takes the median too
    only_unnamed = [learned("x1", "TPU-v9", None, 0.30), backend("a1", "A100-80G", A100)]
    assert ttft(only_unnamed) == pytest.approx([1.0, 1.0])


def test_mixed_tp_scales_by_tp() -> None:
    """TP4 H100s have learned 0.02 ms/token. A young TP2 H100 takes their speed x 2 (the
    old code gave it the TP4 median, as the same GPU label): it predicts twice the time;
    a young TP4 A100 predicts 0.02 x H100 / A100; an L40S with its own learned speed
    joins the geometric mean of the groups for a young TP1 A100."""
    pool = [
        learned("h4a", "H100-SXM", 4 * H100, 0.02),
        learned("h4b", "H100-SXM", 4 * H100, 0.02),
        backend("h2", "H100-SXM", 2 * H100),
        backend("a4", "A100-80G", 4 * A100),
    ]
    assert ttft(pool) == pytest.approx([1.0, 1.0, 0.5, A100 / H100])
    # learned too (0.06: noisy), the TP2 replica pools with the TP4 ones in units of
    # capability (ms/token x TFLOPS: 0.08, 0.08, 0.12 x H100): the median 0.08 / 2
    # gives it 0.04, twice the TP4 speed (not the label's raw median, 0.02)
    pool[2] = learned("h2", "H100-SXM", 2 * H100, 0.06)
    assert ttft(pool) == pytest.approx([1.0, 1.0, 0.5, A100 / H100])
    l40s = L40S_TFLOPS
    mixed = [
        learned("h1", "H100-SXM", H100, 0.05),
        learned("l1", "L40S", l40s, 0.40),
        backend("a1", "A100-80G", A100),
    ]
    unit = math.sqrt(0.05 * H100 * 0.40 * l40s)  # geometric mean of ms/token x capability
    assert ttft(mixed)[2] == pytest.approx(0.05 / (unit / A100))


def test_nothing_learned_yet_keeps_every_speed_at_one() -> None:
    """Before any backend has three first tokens there is no speed to scale: every
    backend predicts 1 ms per token of work (as before the prior), so only the queued
    work tells them apart."""
    pool = [
        backend("a1", "A100-80G", A100),
        backend("h1", "H100-SXM", H100, outstanding_prefill_tokens=1000),
        backend("x", "TPU-v9", None),
    ]
    assert ttft(pool, input_tokens=1000) == pytest.approx([1.0, 0.5, 1.0])
