"""The twin's LoRA flags and registry (vLLM's forms, its LRU slots and CPU cache)."""

from __future__ import annotations

import argparse

import pytest

from kiloserve.engine.cli import add_arguments, config_from_args
from kiloserve.engine.lora import (
    LORA_DISK_LOAD_S,
    LORA_GPU_SWAP_S,
    LoraModule,
    LoraRegistry,
    parse_lora_module,
)
from kiloserve.errors import ConfigError


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0", *argv])


def test_lora_flags_as_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    spec = '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}'
    args = _args(["--enable-lora", "--lora-modules", "sql=/a/sql", spec, "--max-loras", "2"])
    config = config_from_args(args)
    assert config.lora_modules == (
        LoraModule("sql", "/a/sql"),
        LoraModule("chat", "/a/chat", "base"),
    )
    assert config.enable_lora and config.max_loras == 2 and config.allow_runtime_lora_updating
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert not config_from_args(_args([])).allow_runtime_lora_updating


@pytest.mark.parametrize("text", ["sql", "=p", "sql=", '{"name": "x"}', "{bad"])
def test_bad_lora_module_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="--lora-modules"):
        parse_lora_module(text)


def test_swap_cost_follows_gpu_slots_and_cpu_cache() -> None:
    reg = LoraRegistry("base", max_loras=1, max_cpu_loras=2)
    cold, both = LORA_GPU_SWAP_S + LORA_DISK_LOAD_S, LORA_GPU_SWAP_S
    costs = [reg.swap_cost_s(n) for n in ("a", "a", "b", "a", "c", "b")]
    # a cold; a in slot; b cold (a to CPU); a from CPU; c cold (b leaves the CPU cache); b cold
    assert costs == [cold, 0.0, cold, both, cold, cold]
