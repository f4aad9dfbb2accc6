"""``kiloserve up``: every twin's node page (``/node/metrics``) is in the gateway config,
and the node faults of a cluster YAML reach the twin's command line."""

from __future__ import annotations

import argparse

from kiloserve.engine import cli as engine_cli
from kiloserve.launch.cluster import BackendInfo, gateway_config
from kiloserve.launch.config import parse_cluster_config
from kiloserve.launch.engines import twin_argv
from kiloserve.routing.config import BackendConfig


def _info(name: str, engine: str) -> BackendInfo:
    url = "http://127.0.0.1:1"
    return BackendInfo(name, url, "H100", "m", 1, "bf16", 0, "", "", 0.0, 1.0, engine=engine)


def test_twins_get_a_node_metrics_url_real_engines_do_not() -> None:
    cfg = parse_cluster_config(
        {"backends": [{"name": "b", "gpu": "H100", "model": "llama-3.1-8b"}]}
    )
    entries = gateway_config(cfg, [_info("t", "twin"), _info("v", "vllm")], 8000)["backends"]
    assert entries[0]["node_metrics_url"] == "http://127.0.0.1:1/node/metrics"
    assert "node_metrics_url" not in entries[1]
    for entry in entries:
        BackendConfig.model_validate(entry)


def test_node_faults_reach_the_twin_command_line() -> None:
    faults = {"pcie_saturation": 0.5, "nvlink_degrade_at_c": 75.0, "xid": 79, "ecc_dbe_errors": 1}
    backend = {"name": "b", "gpu": "H100", "model": "llama-3.1-8b", "faults": faults}
    item = parse_cluster_config({"backends": [backend]}).expanded()[0]
    argv = twin_argv(item, "127.0.0.1", 8001)
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    twin = engine_cli.config_from_args(parser.parse_args(argv[4:]))
    assert twin.faults.to_json() == faults
