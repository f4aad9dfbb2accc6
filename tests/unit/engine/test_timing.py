"""Step-time model: roofline regimes, monotonicity, bound, closed-form decode runs."""

from __future__ import annotations

import random

import pytest

from kiloserve.catalog import get_gpu, get_model
from kiloserve.engine.timing import StepTimeModel
from kiloserve.errors import CatalogError, ConfigError


@pytest.fixture
def h100_8b() -> StepTimeModel:
    return StepTimeModel(get_gpu("H100"), get_model("llama-3.1-8b"))


def test_single_decode_is_bandwidth_bound(h100_8b: StepTimeModel) -> None:
    # 16.06 GB / (3.35 TB/s x 0.73) = 6.57 ms, + 126 us + 32 x 32 us
    step_s = h100_8b.step_time_s([], [1024])
    assert step_s == pytest.approx(6.57e-3 + 0.126e-3 + 32 * 32e-6 + 4.4e-6, rel=0.02)
    assert 1 / step_s < 3.35e12 / 16.06e9  # below the single-stream ceiling


def test_prefill_is_compute_bound(h100_8b: StepTimeModel) -> None:
    # 2 N T FLOPs at 989 TFLOPS x 0.45 dominates a long prefill
    prefill_s = h100_8b.step_time_s([(8192, 0)], [])
    flops_s = 2 * get_model("llama-3.1-8b").num_params * 8192 / (989e12 * 0.45)
    assert flops_s < prefill_s < 1.3 * flops_s


def test_empty_step_takes_no_time(h100_8b: StepTimeModel) -> None:
    assert h100_8b.step_time_s([], []) == 0.0
    assert h100_8b.decode_steps_time_s(0, 0, 10) == 0.0
    assert h100_8b.decode_steps_time_s(1, 100, 0) == 0.0


def test_monotone_in_batch_and_context(h100_8b: StepTimeModel) -> None:
    times = [h100_8b.step_time_s([], [1000] * batch) for batch in (1, 2, 8, 64, 256, 1024)]
    assert times == sorted(times) and len(set(times)) == len(times)
    times = [h100_8b.step_time_s([], [ctx] * 32) for ctx in (1, 100, 1000, 10_000, 100_000)]
    assert times == sorted(times) and len(set(times)) == len(times)
    chunks = [h100_8b.step_time_s([(n, 0)], [500] * 16) for n in (16, 256, 2048, 8192)]
    assert chunks == sorted(chunks)
    cached = [h100_8b.step_time_s([(512, p)], []) for p in (0, 4096, 32_768)]
    assert cached == sorted(cached) and len(set(cached)) == 3


def test_mixed_batch_costs_more_than_each_part(h100_8b: StepTimeModel) -> None:
    prefill, decodes = [(2048, 0)], [1500] * 64
    mixed = h100_8b.step_time_s(prefill, decodes)
    assert mixed > h100_8b.step_time_s(prefill, [])
    assert mixed > h100_8b.step_time_s([], decodes)


@pytest.mark.parametrize(
    ("gpu", "model", "tp", "quant"),
    [
        ("H100", "llama-3.1-8b", 1, "bf16"),
        ("A100", "qwen2-72b", 4, "bf16"),
        ("L40S", "qwen2-7b", 2, "fp8"),
        ("T4", "qwen2-7b", 1, "int4"),
        ("MI300X", "llama-3.1-70b", 8, "fp8"),
    ],
)
def test_never_faster_than_roofline(gpu: str, model: str, tp: int, quant: str) -> None:
    timing = StepTimeModel(get_gpu(gpu), get_model(model), tp, quant)
    rng = random.Random(7)
    for _ in range(200):
        prefill = [(rng.randint(1, 4096), rng.randint(0, 8192)) for _ in range(rng.randint(0, 3))]
        decodes = [rng.randint(1, 20_000) for _ in range(rng.randint(0, 300))]
        bound = timing.roofline_bound_s(prefill, decodes)
        assert timing.step_time_s(prefill, decodes) >= bound
        if prefill or decodes:
            assert bound > 0


@pytest.mark.parametrize(
    ("gpu", "model", "tp"),
    [("H100", "llama-3.1-8b", 1), ("A100", "qwen2-72b", 4), ("L40S", "qwen3-14b", 2)],
)
def test_decode_steps_equal_summed_single_steps(gpu: str, model: str, tp: int) -> None:
    timing = StepTimeModel(get_gpu(gpu), get_model(model), tp)
    rng = random.Random(11)
    for _ in range(100):
        contexts = [rng.randint(1, 30_000) for _ in range(rng.randint(1, 400))]
        num_steps = rng.randint(1, 300)
        summed = sum(timing.step_time_s([], [c + i for c in contexts]) for i in range(num_steps))
        assert timing.decode_steps_time_s(len(contexts), sum(contexts), num_steps) == pytest.approx(
            summed, rel=1e-9
        )


def test_decode_steps_cross_from_compute_to_memory_bound(h100_8b: StepTimeModel) -> None:
    # 1024 sequences: compute-bound at short contexts (~55 ms of 2 N B FLOPs), then the
    # KV reads grow past that near context ~880, and each step adds far more time.
    contexts = [1] * 1024

    def growth_s(ctx: int) -> float:
        return h100_8b.step_time_s([], [ctx + 1] * 1024) - h100_8b.step_time_s([], [ctx] * 1024)

    assert growth_s(999) > 10 * growth_s(1)
    summed = sum(h100_8b.step_time_s([], [c + i for c in contexts]) for i in range(1000))
    assert h100_8b.decode_steps_time_s(len(contexts), sum(contexts), 1000) == pytest.approx(
        summed, rel=1e-9
    )


def test_tensor_parallel_speeds_up_but_not_linearly() -> None:
    gpu, model = get_gpu("H100"), get_model("llama-3.1-70b")
    tp2 = StepTimeModel(gpu, model, tp=2).step_time_s([], [1024])
    tp4 = StepTimeModel(gpu, model, tp=4).step_time_s([], [1024])
    tp8 = StepTimeModel(gpu, model, tp=8).step_time_s([], [1024])
    assert tp2 > tp4 > tp8
    assert tp4 > tp2 / 2 and tp8 > tp4 / 2  # all-reduce and fixed costs


def test_quantisation_speeds_up_decode() -> None:
    gpu, model = get_gpu("H100"), get_model("llama-3.1-8b")
    bf16 = StepTimeModel(gpu, model).step_time_s([], [512])
    fp8 = StepTimeModel(gpu, model, quant="fp8").step_time_s([], [512])
    int4 = StepTimeModel(gpu, model, quant="int4").step_time_s([], [512])
    assert bf16 > fp8 > int4
    fp8_prefill = StepTimeModel(gpu, model, quant="fp8").step_time_s([(8192, 0)], [])
    assert fp8_prefill < 0.6 * StepTimeModel(gpu, model).step_time_s([(8192, 0)], [])


def test_api_overhead_figures(h100_8b: StepTimeModel) -> None:
    assert h100_8b.per_request_api_overhead_s == pytest.approx(0.015)
    assert h100_8b.per_token_stream_overhead_s == pytest.approx(46e-6)


def test_invalid_arguments() -> None:
    with pytest.raises(ConfigError):
        StepTimeModel(get_gpu("H100"), get_model("llama-3.1-8b"), tp=0)
    with pytest.raises(CatalogError):
        StepTimeModel(get_gpu("H100"), get_model("llama-3.1-8b"), quant="int2")
    with pytest.raises(CatalogError):
        StepTimeModel(get_gpu("H100"), get_model("llama-3.1-8b"), kv_dtype="int2")
