"""Pure pieces of the fault-tolerance layer: probe streaks, node health score, the
registry record format and the agent's flag checks."""

from __future__ import annotations

import argparse

import pytest

from kiloserve.agent.cli import add_arguments, config_from_args
from kiloserve.agent.nvml import health_score
from kiloserve.errors import ConfigError
from kiloserve.gateway.config import BackendConfig
from kiloserve.gateway.registry.etcd import prefix_end
from kiloserve.gateway.registry.record import RegistryRecord, decode_record, encode_record
from kiloserve.gateway.resilience.health import HealthConfig, ProbeTracker


def test_probe_streaks_flip_health_after_n_and_m() -> None:
    t = ProbeTracker(HealthConfig(unhealthy_threshold=3, healthy_threshold=2))
    assert t.record("a", False) is None
    assert t.is_confirming("a")
    assert t.record("a", True) is None  # a success breaks the failure run
    assert [t.record("a", False) for _ in range(3)] == [None, None, False]
    assert not t.is_healthy("a") and not t.is_confirming("a")
    assert t.record("a", True) is None
    assert t.record("a", False) is None  # the success run restarts
    assert [t.record("a", True) for _ in range(2)] == [None, True]
    assert t.is_healthy("a")


def test_health_score_from_nvml() -> None:
    assert health_score(None) == 1.0
    assert health_score({"gpus": [{"temperature_c": 70, "ecc_uncorrected": 0}]}) == 1.0
    assert health_score({"gpus": [{"temperature_c": 95, "ecc_uncorrected": 0}]}) == 0.25
    assert health_score({"gpus": [{"temperature_c": 60}, {"ecc_uncorrected": 2}]}) == 0.0
    assert health_score({"gpus": [{"xid_events": 1}]}) == 0.0


def test_record_round_trip_and_errors() -> None:
    backend = BackendConfig(url="http://10.0.0.5:8000", name="n1", models=["m"], gpu="H100")
    raw = encode_record(RegistryRecord(backend, True, {"score": 0.0}))
    back = decode_record(raw, "/k/n1")
    assert back.backend == backend and back.is_draining and back.health == {"score": 0.0}
    with pytest.raises(ConfigError, match="/k/bad"):
        decode_record(b"not json", "/k/bad")
    with pytest.raises(ConfigError, match="/k/bad"):
        decode_record(b'{"url": "https://x:1"}', "/k/bad")


def test_prefix_end() -> None:
    assert prefix_end("/kiloserve/backends/") == b"/kiloserve/backends0"
    assert prefix_end("a\xff") == b"a\xc3\xc0"  # UTF-8 bytes: last byte + 1


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_agent_flags() -> None:
    cfg = config_from_args(_args("--engine-url", "http://127.0.0.1:9000/", "--etcd", "h:2379"))
    assert cfg.name == "127.0.0.1:9000" and cfg.engine_url == "http://127.0.0.1:9000"
    with pytest.raises(ConfigError, match="engine-url"):
        config_from_args(_args("--engine-url", "ftp://x", "--etcd", "h:1"))
    with pytest.raises(ConfigError, match="interval"):
        config_from_args(_args("--engine-url", "http://x:1", "--etcd", "h:1", "--ttl", "1"))
