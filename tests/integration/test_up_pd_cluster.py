"""``kiloserve up -c examples/cluster-pd.yaml`` (``LocalCluster``, the code it runs): the
twins start with their roles and KV tiers, the gateway knows each backend's role, a
long prompt is split (prefill twin, then a decode twin that pulls the KV) and a short
one runs whole on the ``both`` twin (real processes on 127.0.0.1)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiloserve.gateway.headers import BACKEND_HEADER
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import load_cluster_config
from kiloserve.tokens import filler_text

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
ROLES = {
    "prefill-0": "prefill",
    "prefill-1": "prefill",
    "decode-0": "decode",
    "decode-1": "decode",
    "both": "both",
}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def _post(url: str, body: dict[str, Any]) -> tuple[str, Any]:
    """(the answering backend, the JSON answer)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return str(resp.headers.get(BACKEND_HEADER, "")), json.load(resp)


def _counter(url: str, name: str) -> float:
    """The sum of a metric's samples on a twin's /metrics page (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cfg = load_cluster_config(ROOT / "examples" / "cluster-pd.yaml")
    run_dir = tmp_path_factory.mktemp("up-pd")
    with LocalCluster(cfg, gateway=True, gateway_port=0, run_dir=run_dir) as c:
        yield c


def test_twins_run_with_the_roles_and_tiers_of_the_yaml(cluster: LocalCluster) -> None:
    seen = {}
    for backend in cluster.backends:
        info = _get(backend.url + "/kv_transfer/info")
        seen[backend.name] = info["role"]
        assert info["kv_cpu_gib"] == (32 if info["role"] == "prefill" else 0)
        assert info["kv_link"]["name"] == "network"
    assert seen == ROLES


def test_the_gateway_knows_each_backends_role(cluster: LocalCluster) -> None:
    assert cluster.gateway_url is not None
    rows = _get(cluster.gateway_url + "/admin/backends")["backends"]
    assert {row["name"]: row["role"] for row in rows} == ROLES


def test_a_long_prompt_splits_and_a_short_one_runs_whole(cluster: LocalCluster) -> None:
    assert cluster.gateway_url is not None
    urls = {b.name: b.url for b in cluster.backends}
    xfers = "vllm:nixl_xfer_time_seconds_count"
    before = {name: _counter(url, xfers) for name, url in urls.items()}
    long_body = {"model": "Llama-3.1-8B", "prompt": filler_text(1500, seed=7), "max_tokens": 4}
    backend, answer = _post(cluster.gateway_url + "/v1/completions", long_body)
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["usage"]["prompt_tokens"] >= 1024  # the gateway's min_prompt_tokens
    assert ROLES[backend] == "decode"
    after = {name: _counter(url, xfers) for name, url in urls.items()}
    assert {n for n in urls if after[n] > before[n]} == {backend}  # it pulled the KV
    short_body = {"model": "Llama-3.1-8B", "prompt": filler_text(100, seed=8), "max_tokens": 3}
    backend, answer = _post(cluster.gateway_url + "/v1/completions", short_body)
    assert backend == "both" and answer["usage"]["completion_tokens"] == 3
