"""KV transfer timing (engine/transfer.py) and the P/D fields of EngineConfig."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kiloserve.catalog import get_gpu, get_model
from kiloserve.engine.config import EngineConfig
from kiloserve.engine.setup import engine_config_for, tier_blocks
from kiloserve.engine.transfer import KvLink, kv_transfer_time_s, link_for
from kiloserve.errors import ConfigError


@pytest.mark.parametrize(
    ("gpu", "kind", "bandwidth_bps", "latency_s"),
    [
        ("H100", "network", 50e9, 100e-6),
        ("H100", "pcie", 64e9, 20e-6),
        ("H100", "nvlink", 450e9, 10e-6),
        ("A100", "network", 25e9, 100e-6),
        ("A100", "pcie", 32e9, 20e-6),
        ("L40S", "network", 12.5e9, 100e-6),
        ("T4", "pcie", 16e9, 20e-6),
        ("H200", "network", 50e9, 100e-6),
    ],
)
def test_link_for_reads_the_catalog(
    gpu: str, kind: str, bandwidth_bps: float, latency_s: float
) -> None:
    assert link_for(get_gpu(gpu), kind) == KvLink(kind, bandwidth_bps, latency_s)


def test_link_for_rejects_an_unknown_kind() -> None:
    with pytest.raises(ConfigError, match="nvlink, network, pcie"):
        link_for(get_gpu("H100"), "infiniband")


def test_transfer_time_is_bytes_over_bandwidth_plus_latency() -> None:
    link = KvLink("network", 50e9, 100e-6)
    # Llama-3.1-8B bf16 TP1: 131072 B/token; 1000 tokens = 131.072 MB over 50 GB/s
    assert kv_transfer_time_s(1000, 131072, link) == pytest.approx(0.00262144 + 100e-6)
    assert kv_transfer_time_s(1, 100, KvLink("x", 100.0, 0.5)) == 1.5
    assert kv_transfer_time_s(0, 131072, link) == 0.0


def test_transfer_time_rejects_negative_sizes() -> None:
    with pytest.raises(ConfigError, match="must be >= 0"):
        kv_transfer_time_s(-1, 10, KvLink("x", 1.0, 0.0))


@pytest.mark.parametrize(("bandwidth", "latency"), [(0.0, 0.0), (1.0, -1.0), (float("nan"), 0.0)])
def test_kv_link_rejects_bad_figures(bandwidth: float, latency: float) -> None:
    with pytest.raises(ConfigError, match="link x"):
        KvLink("x", bandwidth, latency)


def test_engine_config_for_fills_the_transfer_figures() -> None:
    gpu, model = get_gpu("H100"), get_model("llama-3.1-8b")
    config, ledger = engine_config_for(gpu, model, role="decode")
    assert config.role == "decode"
    assert ledger.kv_bytes_per_token_per_gpu == 131072
    assert config.kv_bytes_per_block == 16 * 131072
    assert config.kv_bytes_per_token == 131072
    assert config.kv_cpu_bandwidth_bps == 64e9
    assert config.kv_remote_bandwidth_bps == 50e9
    assert (config.kv_cpu_blocks, config.kv_remote_blocks) == (0, 0)
    assert not config.has_kv_tiers


def test_engine_config_for_defaults_match_the_old_limits() -> None:
    gpu, model = get_gpu("A100"), get_model("llama-3.1-8b")
    config, _ = engine_config_for(gpu, model)
    assert config.role == "both"
    plain = dataclasses.replace(
        config, kv_cpu_bandwidth_bps=0.0, kv_remote_bandwidth_bps=0.0, kv_bytes_per_block=0
    )
    assert plain == EngineConfig(
        num_blocks=config.num_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=131072,
        block_size=16,
    )


def test_tier_sizes_are_summed_over_tp_ranks() -> None:
    gpu, model = get_gpu("H100"), get_model("llama-3.1-70b")
    config, ledger = engine_config_for(gpu, model, tp=4, kv_cpu_gib=10.0, kv_remote_gib=2.5)
    # 70B: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 327680 B/token, 81920 per rank
    assert ledger.kv_bytes_per_token_per_gpu == 81920
    assert config.kv_bytes_per_block == 16 * 81920
    assert config.kv_cpu_blocks == 10 * 2**30 // (16 * 327680) == 2048
    assert config.kv_remote_blocks == 512
    assert tier_blocks(0.0, ledger) == 0


@pytest.mark.parametrize("size", [-1.0, float("nan"), float("inf")])
def test_tier_blocks_rejects_bad_sizes(size: float) -> None:
    _, ledger = engine_config_for(get_gpu("H100"), get_model("llama-3.1-8b"))
    with pytest.raises(ConfigError, match="KV tier size"):
        tier_blocks(size, ledger)


def test_engine_config_checks_role_and_tiers() -> None:
    base: dict[str, Any] = {
        "num_blocks": 10,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 8,
        "max_model_len": 64,
    }
    with pytest.raises(ConfigError, match="role must be one of prefill, decode, both"):
        EngineConfig(**base, role="producer")
    with pytest.raises(ConfigError, match="kv_cpu_blocks must be >= 0"):
        EngineConfig(**base, kv_cpu_blocks=-1)
    with pytest.raises(ConfigError, match="kv_cpu_blocks needs kv_cpu_bandwidth_bps"):
        EngineConfig(**base, kv_cpu_blocks=4)
    with pytest.raises(ConfigError, match="kv_remote_blocks needs"):
        EngineConfig(
            **base,
            kv_remote_blocks=4,
            kv_remote_bandwidth_bps=1e9,
        )
    with pytest.raises(ConfigError, match="kv_cpu_bandwidth_bps must be >= 0"):
        EngineConfig(**base, kv_cpu_bandwidth_bps=-1.0)
