"""Backends registered through etcd carry their KV-event endpoints (issue 14)."""

from __future__ import annotations

import argparse

import pytest

from kiloserve.agent.cli import add_arguments, config_from_args
from kiloserve.errors import ConfigError
from kiloserve.gateway.registry.record import RegistryRecord, decode_record, encode_record
from kiloserve.routing.config import BackendConfig


def test_record_round_trip_keeps_kv_event_endpoints() -> None:
    backend = BackendConfig(
        url="http://127.0.0.1:8001",
        name="n1",
        kv_events_endpoint="tcp://127.0.0.1:5557",
        kv_events_replay_endpoint="ipc:///run/kv-replay.sock",
    )
    back = decode_record(encode_record(RegistryRecord(backend)), "/k/n1")
    assert back is not None
    assert back.backend.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert back.backend.kv_events_replay_endpoint == "ipc:///run/kv-replay.sock"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--engine-url", "http://127.0.0.1:8000", "--etcd", "h:1", *argv])


def test_agent_flags_publish_the_endpoints() -> None:
    cfg = config_from_args(_args("--kv-events-endpoint", "tcp://127.0.0.1:5557"))
    assert cfg.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert cfg.kv_events_replay_endpoint is None
    with pytest.raises(ConfigError, match="--kv-events-endpoint"):
        config_from_args(_args("--kv-events-endpoint", "tcp://*:5557"))  # a bind address
