"""Cluster YAML ``role`` / ``kv_cpu_gib`` / ``kv_remote_gib`` / ``kv_link``: validation,
the engine flags ``kiloserve up`` builds from them and the gateway's ``role`` keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiloserve.errors import ConfigError
from kiloserve.launch.cluster import describe_backend, gateway_config
from kiloserve.launch.config import load_cluster_config, parse_cluster_config
from kiloserve.launch.engines import engine_launch, twin_argv

ROOT = Path(__file__).resolve().parents[3]


def _line(name: str, **keys: Any) -> dict[str, Any]:
    return {"name": name, "gpu": "L40S", "model": "llama-3.1-8b"} | keys


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        (
            [_line("p", role="prefill")],
            "model 'llama-3.1-8b' has a role: prefill backend but no role: decode backend",
        ),
        (
            [_line("d", role="decode"), _line("b")],
            "model 'llama-3.1-8b' has a role: decode backend but no role: prefill backend",
        ),
        ([_line("p", role="prefil")], "role: Input should be 'prefill', 'decode' or 'both'"),
        ([_line("p", kv_cpu_gib=-1)], "kv_cpu_gib: Input should be greater than or equal to 0"),
        ([_line("p", kv_remote_gib=-0.5)], "kv_remote_gib: Input should be greater than or"),
        ([_line("p", kv_link="infiniband")], "kv_link: Input should be 'nvlink', 'network'"),
        (
            [_line("p", role="prefill", engine="sglang"), _line("d", role="decode")],
            "role: prefill: only twins and vLLM run prefill/decode roles",
        ),
        (
            [_line("v", engine="vllm", kv_cpu_gib=8)],
            "kv_cpu_gib: the twin's KV tier/link model",
        ),
        ([_line("v", engine="vllm", kv_link="nvlink")], "kv_link: the twin's KV tier/link"),
    ],
)
def test_bad_disagg_keys_are_config_errors_naming_the_key(
    backends: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cluster_config({"backends": backends})


def test_pd_pools_are_checked_per_served_model() -> None:
    """A prefill line of one model does not pair with a decode line of another."""
    cfg = {
        "backends": [
            _line("p", role="prefill"),
            _line("d", role="decode", model="qwen2-7b"),
        ]
    }
    with pytest.raises(ConfigError, match=r"model 'llama-3\.1-8b' has a role: prefill"):
        parse_cluster_config(cfg)
    same_name = [
        _line("p", role="prefill", served_model_name="m"),
        _line("d", role="decode", served_model_name="m"),
    ]
    assert parse_cluster_config({"backends": same_name}).has_pd_pools


def test_example_pd_cluster_twins_get_their_role_and_tier_flags(tmp_path: Path) -> None:
    cfg = load_cluster_config(ROOT / "examples" / "cluster-pd.yaml")
    assert cfg.has_pd_pools
    flags: dict[str, list[str]] = {}
    for item in cfg.expanded():
        argv = engine_launch(item, "127.0.0.1", 9000, tmp_path).argv
        assert argv[1:4] == ["-m", "kiloserve", "engine"]
        flags[item.name] = argv[argv.index("9000") + 1 :]
    assert flags == {
        "prefill-0": ["--role", "prefill", "--kv-cpu-gib", "32"],
        "prefill-1": ["--role", "prefill", "--kv-cpu-gib", "32"],
        "decode-0": ["--role", "decode"],
        "decode-1": ["--role", "decode"],
        "both": [],
    }


def test_every_non_default_value_becomes_a_flag_before_extra_args() -> None:
    cfg = parse_cluster_config(
        {
            "backends": [
                _line(
                    "p",
                    role="prefill",
                    kv_cpu_gib=0.5,
                    kv_remote_gib=100,
                    kv_link="nvlink",
                    extra_args=["--seed", "3"],
                ),
                _line("d", role="decode", kv_link="pcie"),
            ]
        }
    )
    p, d = cfg.expanded()
    assert twin_argv(p, "h", 1)[-10:] == [
        "--role", "prefill", "--kv-cpu-gib", "0.5", "--kv-remote-gib", "100",
        "--kv-link", "nvlink", "--seed", "3",
    ]  # fmt: skip
    assert twin_argv(d, "h", 1)[-4:] == ["--role", "decode", "--kv-link", "pcie"]


def test_a_cluster_without_roles_builds_the_same_command_lines() -> None:
    """No disagg key set: no new flag (``kiloserve up`` starts what it did before)."""
    cfg = load_cluster_config(ROOT / "examples" / "cluster-tiny.yaml")
    for item in cfg.expanded():
        argv = twin_argv(item, "127.0.0.1", 9000)
        assert not [a for a in argv if a.startswith(("--role", "--kv-cpu", "--kv-remote"))]
        assert "--kv-link" not in argv


def test_vllm_with_a_role_gets_the_nixl_connector(tmp_path: Path) -> None:
    lines = [
        _line("p", engine="vllm", role="prefill"),
        _line("d", engine="vllm", role="decode", extra_args=["--kv-transfer-config={}"]),
        _line("b", engine="vllm"),
    ]
    p, d, b = parse_cluster_config({"backends": lines}).expanded()
    launch = engine_launch(p, "127.0.0.1", 1, tmp_path)
    argv = launch.argv
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    # each engine its own NIXL side channel (vLLM's default port 5600 is one per host)
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert int(launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    assert "--role" not in argv  # vLLM has no such flag: the proxy's params pick each leg
    assert engine_launch(d, "127.0.0.1", 1, tmp_path).argv[-1] == "--kv-transfer-config={}"
    assert "--kv-transfer-config" not in engine_launch(d, "127.0.0.1", 1, tmp_path).argv
    assert "--kv-transfer-config" not in engine_launch(b, "127.0.0.1", 1, tmp_path).argv
    consumer = _line("d2", engine="vllm", role="decode", env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "7"})
    _, d2 = parse_cluster_config({"backends": [lines[0], consumer]}).expanded()
    launch = engine_launch(d2, "127.0.0.1", 1, tmp_path)
    config = json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1])
    assert config["kv_role"] == "kv_consumer"
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7"  # the YAML's env wins


def test_gateway_config_carries_each_backends_role() -> None:
    cfg = load_cluster_config(ROOT / "examples" / "cluster-pd.yaml")
    infos = [describe_backend(it, f"http://127.0.0.1:{9000 + i}") for i, it in
             enumerate(cfg.expanded())]  # fmt: skip
    entries = gateway_config(cfg, infos, 8000)["backends"]
    roles = {e["name"]: e.get("role") for e in entries}
    assert roles == {
        "prefill-0": "prefill",
        "prefill-1": "prefill",
        "decode-0": "decode",
        "decode-1": "decode",
        "both": None,  # the gateway's default: a role-less cluster's YAML is unchanged
    }
