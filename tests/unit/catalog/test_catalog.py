"""Catalog: built-in lookups, aliases, user GPUs from YAML, models from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kiloserve.catalog as catalog
from kiloserve.catalog import (
    QUANTS,
    GpuSpec,
    get_gpu,
    get_model,
    list_gpus,
    list_models,
    load_gpus_file,
    load_model_config,
    weight_bytes_per_param,
)
from kiloserve.errors import CatalogError

EXPECTED_GPUS = {"A100-80G", "H100-SXM", "H200", "L40S", "A10", "T4", "MI300X"}
EXPECTED_MODELS = {
    "Qwen2-7B",
    "Qwen2-72B",
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Qwen3-14B",
    "Qwen3-32B",
}


def test_public_surface() -> None:
    for name in catalog.__all__:
        assert hasattr(catalog, name), name


def test_builtin_names() -> None:
    assert {g.name for g in list_gpus()} == EXPECTED_GPUS
    assert {m.name for m in list_models()} == EXPECTED_MODELS


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("H100", "H100-SXM"),
        ("h100-sxm", "H100-SXM"),
        ("a100", "A100-80G"),
        ("A100_80G", "A100-80G"),
        ("mi300x", "MI300X"),
    ],
)
def test_gpu_lookup_case_insensitive(query: str, name: str) -> None:
    assert get_gpu(query).name == name


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("llama-3.1-8b", "Llama-3.1-8B"),
        ("LLAMA-3.1-70B", "Llama-3.1-70B"),
        ("qwen2-72b", "Qwen2-72B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("Qwen/Qwen3-32B", "Qwen3-32B"),
        ("some-org/qwen3-14b", "Qwen3-14B"),
    ],
)
def test_model_lookup_aliases(query: str, name: str) -> None:
    assert get_model(query).name == name


def test_unknown_names_list_valid_ones() -> None:
    with pytest.raises(CatalogError) as gpu_err:
        get_gpu("B200")
    assert "B200" in str(gpu_err.value)
    for name in EXPECTED_GPUS:
        assert name in str(gpu_err.value)
    with pytest.raises(CatalogError) as model_err:
        get_model("gpt-5")
    for name in EXPECTED_MODELS:
        assert name in str(model_err.value)


def test_calibration_figures() -> None:
    h100 = get_gpu("H100")
    assert (h100.tflops_bf16, h100.tflops_fp8, h100.bandwidth_tbs) == (989, 1979, 3.35)
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    assert (get_gpu("L40S").max_num_batched_tokens, get_gpu("L40S").max_num_seqs) == (2048, 256)
    assert get_gpu("MI300X").max_num_seqs == 1024
    assert get_gpu("A100").tflops_fp8 is None
    llama = get_model("llama-3.1-8b")
    assert llama.kv_bytes_per_token() == 128 * 1024
    assert llama.kv_bytes_per_token("fp8") == 64 * 1024
    assert get_model("qwen2-7b").kv_bytes_per_token() == 56 * 1024
    assert get_model("qwen2-72b").kv_bytes_per_token() == 320 * 1024
    assert get_model("qwen3-14b").kv_bytes_per_token() == 160 * 1024
    assert get_model("qwen3-32b").max_model_len == 40960
    assert round(get_model("qwen2-72b").weight_bytes() / 1e9) == 145


def test_kv_heads_shard_then_replicate() -> None:
    qwen7 = get_model("qwen2-7b")  # 4 KV heads
    assert qwen7.kv_bytes_per_token_per_gpu(2) == qwen7.kv_bytes_per_token() // 2
    assert qwen7.kv_bytes_per_token_per_gpu(4) == qwen7.kv_bytes_per_token() // 4
    assert qwen7.kv_bytes_per_token_per_gpu(8) == qwen7.kv_bytes_per_token() // 4


def test_quant_bytes() -> None:
    assert weight_bytes_per_param("bf16") == 2
    assert weight_bytes_per_param("FP16") == 2
    assert weight_bytes_per_param("fp8") == 1
    assert weight_bytes_per_param("int8") == 1
    assert weight_bytes_per_param("int4") == 0.5
    assert set(QUANTS) == {"bf16", "fp16", "fp8", "int8", "int4"}
    with pytest.raises(CatalogError, match="int3"):
        weight_bytes_per_param("int3")
    with pytest.raises(CatalogError, match="valid"):
        get_model("qwen2-7b").kv_bytes_per_token("int4")


def test_fp8_peak_only_where_the_card_has_it() -> None:
    assert get_gpu("H100").peak_flops("fp8") == 1979e12
    assert get_gpu("A100").peak_flops("fp8") == 312e12
    assert get_gpu("H100").peak_flops("int4") == 989e12


GPU_YAML = """
- name: B200
  aliases: [b200-sxm]
  tflops_bf16: 2250
  tflops_fp8: 4500
  bandwidth_tbs: 8.0
  memory_gb: 180
  prefill_mfu: 0.45
  decode_mfu: 0.3
  cost_per_hour: 5.0
  max_num_batched_tokens: 8192
  max_num_seqs: 1024
"""


def test_user_gpu_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(GPU_YAML)
    extra = load_gpus_file(path)
    spec = get_gpu("B200-SXM", extra)
    assert isinstance(spec, GpuSpec)
    assert (spec.memory_gb, spec.tflops_fp8, spec.max_num_seqs) == (180.0, 4500.0, 1024)
    assert get_gpu("H100", extra).name == "H100-SXM"  # built-ins still there


def test_user_gpu_typo_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(GPU_YAML.replace("memory_gb", "memory_gib"))
    with pytest.raises(CatalogError) as err:
        load_gpus_file(path)
    assert "memory_gib" in str(err.value) and "memory_gb" in str(err.value)


def test_user_gpu_bad_value(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(GPU_YAML.replace("bandwidth_tbs: 8.0", "bandwidth_tbs: fast"))
    with pytest.raises(CatalogError, match="bandwidth_tbs"):
        load_gpus_file(path)
    path.write_text(GPU_YAML.replace("decode_mfu: 0.3", "decode_mfu: -1"))
    with pytest.raises(CatalogError, match="decode_mfu"):
        load_gpus_file(path)


LLAMA_8B_CONFIG = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def test_model_from_hf_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    spec = load_model_config(tmp_path)  # a folder works too
    builtin = get_model("llama-3.1-8b")
    assert spec.name == "Llama-3.1-8B-Instruct"
    assert spec.head_dim == 128  # hidden / heads when absent
    assert spec.num_params == builtin.num_params  # computed from the dimensions
    assert spec.kv_bytes_per_token() == builtin.kv_bytes_per_token()
    assert spec.max_model_len == 131072
    assert get_model("llama-3.1-8b-instruct", {spec.name: spec}) is spec


def test_model_from_hf_config_tied_and_explicit_head_dim(tmp_path: Path) -> None:
    config = {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = load_model_config(path, name="Qwen2.5-0.5B", max_model_len=4096)
    assert spec.name == "Qwen2.5-0.5B" and spec.max_model_len == 4096
    assert 0.48e9 < spec.num_params < 0.50e9  # Qwen2.5-0.5B: 494M (tied embeddings)


def test_model_config_missing_key(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in LLAMA_8B_CONFIG.items() if k != "vocab_size"}))
    with pytest.raises(CatalogError, match="vocab_size"):
        load_model_config(path)
    with pytest.raises(CatalogError, match="cannot read"):
        load_model_config(tmp_path / "missing.json")


def test_gpu_kv_links_default_and_parse(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(GPU_YAML)
    spec = load_gpus_file(path)["B200"]
    assert (spec.network_bandwidth_gbs, spec.pcie_bandwidth_gbs) == (25.0, 32.0)
    path.write_text(GPU_YAML + "  network_bandwidth_gbs: 50\n  pcie_bandwidth_gbs: 64\n")
    spec = load_gpus_file(path)["B200"]
    assert (spec.network_bandwidth_gbs, spec.pcie_bandwidth_gbs) == (50.0, 64.0)
    path.write_text(GPU_YAML + "  pcie_bandwidth_gbs: 0\n")
    with pytest.raises(CatalogError, match="pcie_bandwidth_gbs must be positive"):
        load_gpus_file(path)


@pytest.mark.parametrize(
    ("name", "network_gbs", "pcie_gbs"),
    [
        ("A100-80G", 25.0, 32.0),
        ("H100-SXM", 50.0, 64.0),
        ("H200", 50.0, 64.0),
        ("L40S", 12.5, 32.0),
        ("A10", 12.5, 32.0),
        ("T4", 12.5, 16.0),
        ("MI300X", 50.0, 64.0),
    ],
)
def test_builtin_gpu_kv_links(name: str, network_gbs: float, pcie_gbs: float) -> None:
    spec = get_gpu(name)
    assert (spec.network_bandwidth_gbs, spec.pcie_bandwidth_gbs) == (network_gbs, pcie_gbs)
