"""LoRA on real vLLM (CPU) behind the gateway: a rank-2 adapter made for the tiny model
(``scripts/make_tiny_lora.py``), served with ``--lora-modules`` and routed by name; a
second name for it, known only to the gateway's config, is loaded on a miss."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, SERVED_MODEL, START_TIMEOUT_S, RealEnv, http_json, vllm_backend
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def lora_cluster(
    real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, Path]]:
    """One vLLM (core 0) with the adapter as ``tiny-lora``, and the gateway."""
    if real_env.vllm_skip:
        pytest.skip(f"real vLLM unavailable: {real_env.vllm_skip}")
    adapter = tmp_path_factory.mktemp("adapter") / "tiny-lora"
    script = str(REPO / "scripts" / "make_tiny_lora.py")
    subprocess.run([real_env.python, script, real_env.model_dir, str(adapter)], check=True)
    backend = vllm_backend("vllm-lora", real_env, 0)
    backend["extra_args"] += [
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
        "--lora-modules", f"tiny-lora={adapter}",
    ]  # fmt: skip
    backend["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    cfg = parse_cluster_config({"name": "real-lora", "gateway": {"port": 0}, "backends": [backend]})
    lora = {
        "max_adapters_per_backend": 1,
        "adapters": {"tiny-lora-2": {"path": str(adapter), "base_model": SERVED_MODEL}},
    }
    cluster = LocalCluster(
        cfg, run_dir=tmp_path_factory.mktemp("lora-cluster"), start_timeout_s=START_TIMEOUT_S,
        gateway_options={
            "scrape_interval_s": 0.1, "scrape_timeout_s": 3.0, "stale_after_s": 10.0,
            "discovery_interval_s": 0.5, "lora": lora,
        },
    )  # fmt: skip
    with cluster:
        yield cluster, adapter


def _complete(url: str, model: str) -> dict[str, object]:
    body = {"model": model, "prompt": "The capital of", "max_tokens": 4}
    out: dict[str, object] = http_json(url + "/v1/completions", body)
    return out


def _adapters(backend_url: str) -> set[str]:
    cards = http_json(backend_url + "/v1/models")["data"]
    return {c["id"] for c in cards if c.get("parent") == SERVED_MODEL}


def test_adapter_routed_and_loaded_on_a_miss(lora_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, _ = lora_cluster
    url = cluster.gateway_url
    assert url is not None
    backend_url = cluster.backends[0].url
    assert _adapters(backend_url) == {"tiny-lora"}
    out = _complete(url, "tiny-lora")
    assert out["model"] == "tiny-lora"
    out = _complete(url, "tiny-lora-2")  # loaded by the gateway; tiny-lora evicted (budget 1)
    assert out["model"] == "tiny-lora-2"
    assert _adapters(backend_url) == {"tiny-lora-2"}
    assert _complete(url, SERVED_MODEL)["model"] == SERVED_MODEL
