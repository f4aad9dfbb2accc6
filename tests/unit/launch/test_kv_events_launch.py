"""Cluster YAML ``kv_events_endpoint`` / ``kv_events_replay_endpoint``: validation, the
addresses ``auto`` resolves to, and the engine flags and gateway keys they become."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kiloserve.errors import ConfigError
from kiloserve.launch.cluster import BackendInfo, free_ports, gateway_config
from kiloserve.launch.config import parse_cluster_config
from kiloserve.launch.engines import (
    KvEventsEndpoints,
    engine_launch,
    kv_events_endpoints,
    num_kv_events_ports,
)
from kiloserve.routing.config import BackendConfig


def _cluster(**backend: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "b", "gpu": "H100", "model": "llama-3.1-8b"}
    return {"backends": [base | backend]}


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        (
            {"count": 2, "kv_events_endpoint": "tcp://127.0.0.1:5557"},
            "kv_events_endpoint: an explicit endpoint serves one replica, this line has count 2",
        ),
        (
            {"count": 3, "kv_events_endpoint": "auto", "kv_events_replay_endpoint": "ipc:///r"},
            "kv_events_replay_endpoint: an explicit endpoint serves one replica",
        ),
        ({"kv_events_replay_endpoint": "auto"}, "kv_events_replay_endpoint needs kv_events_"),
        ({"kv_events_endpoint": "tcp://*:5557"}, "kv_events_endpoint: must be 'auto', tcp://"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:0"}, "kv_events_endpoint: must be 'auto'"),
        ({"kv_events_endpoint": "5557"}, "kv_events_endpoint: must be 'auto'"),
        (
            {"engine": "vllm", "kv_events_endpoint": "tcp://127.0.0.1:5557"},
            "kv_events_endpoint: vLLM binds only wildcard and ipc:// endpoints",
        ),
        (
            {"engine": "sglang", "kv_events_endpoint": "auto"},
            "kv_events_endpoint: only twins and vLLM publish KV events",
        ),
    ],
)
def test_bad_kv_events_keys_are_config_errors_naming_the_key(
    backend: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        parse_cluster_config(_cluster(**backend))


def test_valid_kv_events_keys() -> None:
    for backend in (
        {"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "auto"},
        {"kv_events_endpoint": "ipc:///tmp/kv.sock"},
        {"count": 4, "kv_events_endpoint": "auto", "kv_events_replay_endpoint": "auto"},
        {"engine": "vllm", "kv_events_endpoint": "ipc:///tmp/kv.sock"},
    ):
        parse_cluster_config(_cluster(**backend))


def test_auto_twin_replicas_take_distinct_ports(tmp_path: Path) -> None:
    cfg = parse_cluster_config(
        _cluster(count=2, kv_events_endpoint="auto", kv_events_replay_endpoint="auto")
    )
    items = cfg.expanded()
    assert [num_kv_events_ports(it.spec) for it in items] == [2, 2]
    ports = iter(free_ports("127.0.0.1", 4))
    kvs = [kv_events_endpoints(it, "127.0.0.1", tmp_path, ports) for it in items]
    addresses = [a for kv in kvs if kv is not None for a in (kv.endpoint, kv.replay_endpoint)]
    assert len(set(addresses)) == 4
    assert all(str(a).startswith("tcp://127.0.0.1:") for a in addresses)
    argv = engine_launch(items[1], "127.0.0.1", 8001, tmp_path, kvs[1]).argv
    assert kvs[1] is not None
    i = argv.index("--kv-events-endpoint")
    assert argv[i : i + 4] == [
        "--kv-events-endpoint",
        kvs[1].endpoint,
        "--kv-events-replay-endpoint",
        kvs[1].replay_endpoint,
    ]


def test_explicit_twin_endpoint_is_passed_as_given(tmp_path: Path) -> None:
    cfg = parse_cluster_config(_cluster(kv_events_endpoint="tcp://127.0.0.1:5557"))
    (item,) = cfg.expanded()
    kv = kv_events_endpoints(item, "127.0.0.1", tmp_path, iter(()))
    assert kv == KvEventsEndpoints("tcp://127.0.0.1:5557", None)
    argv = engine_launch(item, "127.0.0.1", 8000, tmp_path, kv).argv
    assert "--kv-events-replay-endpoint" not in argv
    assert argv[argv.index("--kv-events-endpoint") + 1] == "tcp://127.0.0.1:5557"
    assert "--kv-events-endpoint" not in engine_launch(item, "127.0.0.1", 8000, tmp_path).argv


def test_vllm_auto_gets_ipc_sockets_in_its_scratch_folder(tmp_path: Path) -> None:
    cfg = parse_cluster_config(
        _cluster(
            engine="vllm",
            count=2,
            kv_events_endpoint="auto",
            kv_events_replay_endpoint="auto",
        )
    )
    items = cfg.expanded()
    assert [num_kv_events_ports(it.spec) for it in items] == [0, 0]
    no_ports: itertools.count[int] = itertools.count()
    kvs = [kv_events_endpoints(it, "127.0.0.1", tmp_path, no_ports) for it in items]
    assert next(no_ports) == 0  # vLLM took no tcp port
    scratch = tmp_path.resolve() / "scratch"
    assert kvs == [
        KvEventsEndpoints(
            f"ipc://{scratch}/b-{i}/kv/events.sock", f"ipc://{scratch}/b-{i}/kv/replay.sock"
        )
        for i in range(2)
    ]
    assert (scratch / "b-0" / "kv").is_dir()
    argv = engine_launch(items[0], "127.0.0.1", 8000, tmp_path, kvs[0]).argv
    flag = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert flag == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{scratch}/b-0/kv/events.sock",
        "replay_endpoint": f"ipc://{scratch}/b-0/kv/replay.sock",
    }


def test_long_run_dir_is_refused_for_vllm_ipc_sockets(tmp_path: Path) -> None:
    cfg = parse_cluster_config(_cluster(engine="vllm", kv_events_endpoint="auto"))
    (item,) = cfg.expanded()
    with pytest.raises(ConfigError, match="longer than 107 bytes; use a shorter --run-dir"):
        kv_events_endpoints(item, "127.0.0.1", tmp_path / ("x" * 120), iter(()))


def _info(name: str, **kv: str) -> BackendInfo:
    return BackendInfo(
        name, "http://127.0.0.1:1", "H100", "m", 1, "bf16", 0, "", "", 0.0, 1.0, **kv
    )


def test_gateway_config_carries_the_connect_addresses() -> None:
    cfg = parse_cluster_config(_cluster())
    backends = [
        _info("a", kv_events_endpoint="tcp://127.0.0.1:7001"),
        _info(
            "b",
            kv_events_endpoint="ipc:///run/b/kv/events.sock",
            kv_events_replay_endpoint="ipc:///run/b/kv/replay.sock",
        ),
        _info("c"),
    ]
    entries = gateway_config(cfg, backends, 8000)["backends"]
    assert entries[0]["kv_events_endpoint"] == "tcp://127.0.0.1:7001"
    assert "kv_events_replay_endpoint" not in entries[0]
    assert entries[1]["kv_events_replay_endpoint"] == "ipc:///run/b/kv/replay.sock"
    assert not {"kv_events_endpoint", "kv_events_replay_endpoint"} & set(entries[2])
    for entry in entries:
        BackendConfig.model_validate(entry)  # what the gateway will read
