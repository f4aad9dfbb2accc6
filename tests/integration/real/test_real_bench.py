"""``kiloserve bench`` against a real vLLM instance and through the gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SERVED_MODEL, http_text, metric_sum
from kiloserve.launch.cluster import LocalCluster

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

NUM_REQUESTS = 12
WORKLOAD = "synthetic:input=uniform(20,60),output=16"


def _bench(url: str, out: Path) -> dict[str, object]:
    argv = [sys.executable, "-m", "kiloserve", "bench", "--url", url, "--model", SERVED_MODEL]
    argv += ["--workload", WORKLOAD, "--num-requests", str(NUM_REQUESTS), "--concurrency", "4"]
    argv += ["--out", str(out), "--no-plots", "--no-progress", "--seed", "3"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def _generated(cluster: LocalCluster) -> float:
    pages = [http_text(b.url + "/metrics") for b in cluster.backends]
    return sum(metric_sum(p, "vllm:generation_tokens_total") for p in pages)


def test_bench_direct_against_vllm(vllm_cluster: LocalCluster, tmp_path: Path) -> None:
    before = _generated(vllm_cluster)
    summary = _bench(vllm_cluster.backends[0].url, tmp_path / "direct")
    assert summary["requests_ok"] == NUM_REQUESTS
    assert summary["requests_failed"] == 0
    assert summary["output_tokens_total"] == NUM_REQUESTS * 16
    assert _generated(vllm_cluster) - before == NUM_REQUESTS * 16
    ttft = summary["ttft_ms"]
    assert isinstance(ttft, dict) and ttft["p50"] > 0


def test_bench_through_gateway_spreads_load(vllm_cluster: LocalCluster, tmp_path: Path) -> None:
    assert vllm_cluster.gateway_url is not None
    before = _generated(vllm_cluster)
    summary = _bench(vllm_cluster.gateway_url, tmp_path / "gateway")
    assert summary["requests_ok"] == NUM_REQUESTS
    assert summary["output_tokens_total"] == NUM_REQUESTS * 16
    assert _generated(vllm_cluster) - before == NUM_REQUESTS * 16
    per_backend = summary["per_backend"]
    assert isinstance(per_backend, dict)
    # Four in flight against two engines of max-num-seqs 2: both must serve.
    assert set(per_backend) == {"vllm-a", "vllm-b"}
