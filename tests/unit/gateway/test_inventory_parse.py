"""Parsing what engines say about themselves (S5.5, gateway/inventory.py): the shapes
of vLLM's /version, /v1/models and vllm:cache_config_info, SGLang's /get_server_info
and llama.cpp's /props."""

from __future__ import annotations

from typing import Any

import pytest

from kiloserve.gateway.inventory import (
    parse_cache_config,
    parse_llamacpp_props,
    parse_models,
    parse_sglang_server_info,
    parse_vllm_version,
)


def test_vllm_version_and_model_card() -> None:
    assert parse_vllm_version({"version": "0.8.5.post1"}) == "0.8.5.post1"
    assert parse_vllm_version(["0.8"]) == ""
    card = {"id": "llama", "object": "model", "root": "meta-llama/Llama-3.1-8B-Instruct",
            "parent": None, "max_model_len": 131072}  # fmt: skip
    assert parse_models({"object": "list", "data": [card]}) == {
        "model_root": "meta-llama/Llama-3.1-8B-Instruct",
        "max_model_len": 131072,
    }
    assert parse_models({"data": [{"id": "x", "max_model_len": True}]}) == {}
    assert parse_models({"data": []}) == {} == parse_models(None)


def test_cache_config_info_labels() -> None:
    page = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",'
        'enable_prefix_caching="True",num_gpu_blocks="27000"} 1.0\n'
        'vllm:num_requests_running{model_name="m"} 0.0\n'
    )
    assert parse_cache_config(page) == {
        "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
        "num_gpu_blocks": "27000",
    }  # fmt: skip
    assert parse_cache_config('vllm:num_requests_running{model_name="m"} 0\n') == {}


def test_sglang_server_info() -> None:
    info = {"model_path": "Qwen/Qwen2.5-7B-Instruct", "tokenizer_path": "Qwen/Qwen2.5-7B-Instruct",
            "context_length": 32768, "tp_size": 1, "version": "0.4.6.post2"}  # fmt: skip
    assert parse_sglang_server_info(info) == {
        "engine": "sglang",
        "engine_version": "0.4.6.post2",
        "model_root": "Qwen/Qwen2.5-7B-Instruct",
        "max_model_len": 32768,
    }
    no_ctx = {"model_path": "m", "context_length": None, "version": "0.4"}
    assert "max_model_len" not in parse_sglang_server_info(no_ctx)
    assert parse_sglang_server_info("nope") == {}


@pytest.mark.parametrize(
    "props",
    [
        {"build_info": "b5460-aa50ba46", "model_path": "/models/tiny.gguf", "n_ctx": 4096},
        {"build_info": "b5460-aa50ba46", "model_path": "/models/tiny.gguf",
         "default_generation_settings": {"n_ctx": 4096, "temperature": 0.8}},
    ],
)  # fmt: skip
def test_llamacpp_props(props: dict[str, Any]) -> None:
    assert parse_llamacpp_props(props) == {
        "engine": "llamacpp",
        "engine_version": "b5460-aa50ba46",
        "model_root": "/models/tiny.gguf",
        "max_model_len": 4096,
    }


def test_remote_strings_are_clipped() -> None:
    assert len(parse_vllm_version({"version": "v" * 10_000})) == 200
