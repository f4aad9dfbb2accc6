"""Memory ledger: KV capacity, TP sharding, does-not-fit messages and suggestions."""

from __future__ import annotations

import pytest

from kiloserve.catalog import GIB, get_gpu, get_model
from kiloserve.catalog.memory import FitSuggestion, plan_memory, smallest_fitting
from kiloserve.errors import ConfigError, DoesNotFitError


def test_llama_8b_on_h100_kv_capacity() -> None:
    ledger = plan_memory(get_gpu("H100"), get_model("llama-3.1-8b"))
    # (80 GiB x 0.92 - 16.06 GB - 5.5 GiB - 0.15 GiB) / 128 KiB per token
    assert 400_000 < ledger.kv_capacity_tokens < 460_000
    assert ledger.kv_capacity_tokens == ledger.num_kv_blocks * 16
    assert ledger.weight_bytes_per_gpu == get_model("llama-3.1-8b").num_params * 2
    assert ledger.runtime_bytes == int(0.15 * GIB)
    assert ledger.is_fitting
    assert "434,112 tokens" in ledger.summary()


def test_ledger_adds_up() -> None:
    ledger = plan_memory(get_gpu("A100"), get_model("qwen3-14b"))
    used = (
        ledger.weight_bytes_per_gpu
        + ledger.activation_bytes
        + ledger.runtime_bytes
        + ledger.kv_cache_bytes_per_gpu
    )
    spare = ledger.usable_bytes_per_gpu - used
    assert 0 <= spare < ledger.block_size * ledger.kv_bytes_per_token_per_gpu


def test_tp_shards_weights_and_kv() -> None:
    model = get_model("llama-3.1-70b")
    tp4 = plan_memory(get_gpu("H100"), model, tp=4)
    tp8 = plan_memory(get_gpu("H100"), model, tp=8)
    assert tp4.weight_bytes_per_gpu == pytest.approx(model.num_params * 2 / 4, abs=1)
    assert tp4.kv_bytes_per_token_per_gpu == model.kv_bytes_per_token() // 4
    assert tp8.kv_bytes_per_token_per_gpu == model.kv_bytes_per_token() // 8
    assert tp4.runtime_bytes == int(0.6 * GIB)
    assert tp8.kv_capacity_tokens > 2 * tp4.kv_capacity_tokens  # less weight per GPU too


def test_quant_and_kv_dtype_grow_capacity() -> None:
    gpu, model = get_gpu("L40S"), get_model("qwen2-7b")
    bf16 = plan_memory(gpu, model)
    fp8 = plan_memory(gpu, model, quant="fp8")
    fp8_kv = plan_memory(gpu, model, quant="fp8", kv_dtype="fp8")
    assert fp8.weight_bytes_per_gpu == bf16.weight_bytes_per_gpu // 2
    assert bf16.kv_capacity_tokens < fp8.kv_capacity_tokens
    assert fp8_kv.kv_capacity_tokens // 16 in range(
        2 * fp8.kv_capacity_tokens // 16 - 1, 2 * fp8.kv_capacity_tokens // 16 + 2
    )


def test_qwen2_72b_on_one_h100_does_not_fit() -> None:
    with pytest.raises(DoesNotFitError) as err:
        plan_memory(get_gpu("H100"), get_model("qwen2-72b"))
    assert str(err.value) == (
        "Qwen2-72B bf16 needs 145 GB of weights; one H100-SXM has 80 GB: use --tp 4 or --quant int4"
    )


def test_tp2_message_gives_per_gpu_figure() -> None:
    with pytest.raises(DoesNotFitError, match=r"per GPU at TP2.*use --tp 4 or --quant fp8"):
        plan_memory(get_gpu("H100"), get_model("qwen2-72b"), tp=2)


def test_weights_fit_but_no_room_for_kv_says_what_is_missing() -> None:
    with pytest.raises(DoesNotFitError) as err:
        plan_memory(get_gpu("H100"), get_model("qwen2-72b"), quant="fp8")
    message = str(err.value)
    assert "weights fit" in message
    assert "32768-token sequence needs 11 GB (10 GB missing)" in message
    assert "--tp 2" in message and "--quant int4" in message


def test_shorter_max_model_len_can_fit() -> None:
    ledger = plan_memory(get_gpu("A10"), get_model("llama-3.1-8b"), max_model_len=8192)
    assert ledger.kv_capacity_tokens >= 8192
    with pytest.raises(DoesNotFitError, match="131072-token"):
        plan_memory(get_gpu("A10"), get_model("llama-3.1-8b"))


def test_nothing_fits() -> None:
    with pytest.raises(DoesNotFitError, match="larger GPU"):
        plan_memory(get_gpu("T4"), get_model("qwen2-72b"))


def test_smallest_fitting() -> None:
    h100, qwen72 = get_gpu("H100"), get_model("qwen2-72b")
    assert smallest_fitting(h100, qwen72) == FitSuggestion(tp=4, quant="int4")
    assert smallest_fitting(h100, qwen72, quant="int4") == FitSuggestion(tp=1, quant="int4")
    assert smallest_fitting(h100, qwen72, tp=4) == FitSuggestion(tp=4, quant="bf16")
    assert smallest_fitting(get_gpu("H200"), get_model("llama-3.1-70b")).tp == 2
    assert smallest_fitting(get_gpu("T4"), qwen72) == FitSuggestion(tp=None, quant=None)


def test_invalid_settings() -> None:
    gpu, model = get_gpu("H100"), get_model("qwen2-7b")
    with pytest.raises(ConfigError, match="28 attention heads"):
        plan_memory(gpu, model, tp=8)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        plan_memory(gpu, model, gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="tp must be"):
        plan_memory(gpu, model, tp=0)
    with pytest.raises(ConfigError, match="max_model_len"):
        plan_memory(gpu, model, max_model_len=0)
