"""How ``kiloserve up`` launches each engine type (pure: no engine is started here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiloserve.errors import ConfigError
from kiloserve.launch.cluster import describe_backend, gateway_config
from kiloserve.launch.config import load_cluster_config, parse_cluster_config
from kiloserve.launch.engines import engine_launch

REPO = Path(__file__).resolve().parents[3]


def _launch(line: dict[str, Any], tmp_path: Path) -> Any:
    item = parse_cluster_config({"backends": [line]}).expanded()[0]
    return engine_launch(item, "127.0.0.1", 4321, tmp_path)


def test_vllm_command_line_env_and_dialect(tmp_path: Path) -> None:
    launch = _launch(
        {
            "name": "v",
            "engine": "vllm",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "served_model_name": "llama",
            "python": "/opt/vllm/bin/python",
            "tp": 2,
            "max_num_seqs": 8,
            "env": {"CUDA_VISIBLE_DEVICES": "0,1", "TMPDIR": "/override"},
            "extra_args": ["--enforce-eager"],
        },
        tmp_path,
    )
    assert launch.argv == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama",
        "--host", "127.0.0.1", "--port", "4321", "--tensor-parallel-size", "2",
        "--max-num-seqs", "8", "--enforce-eager",
    ]  # fmt: skip
    assert launch.dialect == "vllm" and launch.health_path == "/health"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert launch.env["TMPDIR"] == "/override"  # the YAML's env wins
    assert Path(launch.env["VLLM_RPC_BASE_PATH"]).is_dir()
    assert str(tmp_path) in launch.env["VLLM_CACHE_ROOT"]


def test_llamacpp_slots_and_context(tmp_path: Path) -> None:
    launch = _launch(
        {
            "name": "l",
            "engine": "llama.cpp",
            "model": "tiny",
            "model_path": "/m/tiny.gguf",
            "command": "/bin/llama-server",
            "max_num_seqs": 4,
            "max_model_len": 512,
        },
        tmp_path,
    )
    assert launch.argv == [
        "/bin/llama-server", "-m", "/m/tiny.gguf", "--alias", "tiny", "--host", "127.0.0.1",
        "--port", "4321", "--metrics", "-np", "4", "-c", "2048",
    ]  # fmt: skip
    assert launch.dialect == "llamacpp"


def test_sglang_and_twin_dialects(tmp_path: Path) -> None:
    sglang = _launch({"name": "s", "engine": "sglang", "model": "m", "tp": 2}, tmp_path)
    assert sglang.argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-metrics" in sglang.argv and sglang.dialect == "sglang"
    twin = _launch({"name": "t", "gpu": "H100", "model": "llama-3.1-8b"}, tmp_path)
    assert twin.argv[1:4] == ["-m", "kiloserve", "engine"] and twin.dialect == "vllm"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"name": "l", "engine": "llama.cpp", "model": "m"}, "needs model_path"),
        ({"name": "t", "model": "llama-3.1-8b"}, "twin needs 'gpu'"),
        ({"name": "t", "gpu": "H100", "model": "x", "python": "/p"}, "only for real engines"),
        ({"name": "v", "engine": "vllm", "model": "m", "faults": {"hang": True}}, "twins only"),
        ({"name": "v", "engine": "tgi", "model": "m"}, "engine"),
    ],
)
def test_invalid_engine_lines(line: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster_config({"backends": [line]})


def test_gateway_config_sets_each_dialect() -> None:
    cfg = load_cluster_config(REPO / "examples" / "cluster-gpu.yaml")
    infos = [describe_backend(it, f"http://h:{i}") for i, it in enumerate(cfg.expanded())]
    conf = gateway_config(cfg, infos, 8000)
    assert {b["name"]: b["engine"] for b in conf["backends"]} == {
        "vllm-llama-0": "vllm",
        "vllm-llama-1": "vllm",
        "vllm-70b": "vllm",
        "sglang-llama": "sglang",
        "llamacpp-llama": "llamacpp",
        "twin-llama": "vllm",
    }
    assert [i.kv_capacity_tokens > 0 for i in infos] == [False] * 5 + [True]  # twin: planned


def test_cpu_example_parses_and_expands_home(tmp_path: Path) -> None:
    cfg = load_cluster_config(REPO / "examples" / "cluster-real-cpu.yaml")
    assert [b.engine for b in cfg.backends] == ["vllm", "vllm", "llama.cpp"]
    launches = [engine_launch(it, "127.0.0.1", 1, tmp_path) for it in cfg.expanded()]
    home = str(Path.home())
    assert launches[0].argv[0] == f"{home}/.cache/kiloserve/real-venv/bin/python"
    assert launches[0].argv[4] == f"{home}/.cache/kiloserve/tiny-model"
    assert launches[2].argv[:3] == [
        f"{home}/.cache/kiloserve/llama.cpp/bin/llama-server",
        "-m",
        f"{home}/.cache/kiloserve/tiny-model/tiny.gguf",
    ]
