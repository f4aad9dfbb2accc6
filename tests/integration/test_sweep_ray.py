"""Sweeps (``kiloserve sim`` policies, ``kiloserve plan`` rate searches, Pareto sizes and
stages) give the same results in process (``--jobs 1``), on a local process pool
(``--jobs 2``) and on a real local Ray head (``--ray ADDRESS``): only the wall-clock
keys differ. The Ray head is started here (``ray start --head --block``) and stopped
afterwards; the tests skip only when Ray is not installed."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from kiloserve.catalog import get_gpu, get_model
from kiloserve.plan.capacity import capacity_from_sweep, parse_percentile_slo
from kiloserve.plan.planner import enumerate_candidates
from kiloserve.plan.stage_runs import run_stages
from kiloserve.sim.sweep import WALL_CLOCK_KEYS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
SIM_WORKLOAD = "synthetic:input=uniform(32,300),output=uniform(8,64)"
PLAN_WORKLOAD = "synthetic:input=fixed(200),output=fixed(20)"
SLO = ["--slo", "ttft_p95=300ms,tpot_p95=40ms"]
HEAD_START_S = 120.0


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Ray head on 127.0.0.1 (no dashboard, a small object store), its own
    process group, stopped (SIGTERM, then SIGKILL to that group) afterwards."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "head.log"
    ray_cli = Path(sys.executable).with_name("ray")
    cmd = [str(ray_cli), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(port), "--include-dashboard=false", "--num-cpus", "2",
           "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]  # fmt: skip
    env = os.environ | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    with log.open("wb") as out:
        head = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        _wait_for_head(head, log)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)  # what the head left in its group


def _wait_for_head(head: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + HEAD_START_S
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if head.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ray head did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)


def _kiloserve(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiloserve", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _host_free(value: Any) -> Any:
    """``value`` without the wall-clock keys and the command line, at any depth."""
    if isinstance(value, dict):
        skip = WALL_CLOCK_KEYS | {"command"}
        return {k: _host_free(v) for k, v in value.items() if k not in skip}
    if isinstance(value, list):
        return [_host_free(v) for v in value]
    return value


def _read(path: Path) -> Any:
    return _host_free(json.loads(path.read_text()))


WAYS = {"one": ["--jobs", "1"], "pool": ["--jobs", "2"]}


def test_sim_policies_agree_in_process_on_a_pool_and_on_ray(
    tmp_path: Path, ray_address: str
) -> None:
    policies = ["round_robin", "least_request", "default"]
    ways = WAYS | {"ray": ["--ray", ray_address]}
    for way, flags in ways.items():
        _kiloserve(
            "sim", "-c", str(ROOT / "examples" / "cluster.yaml"), "--workload", SIM_WORKLOAD,
            "--rate", "6", "--num-requests", "60", "--no-plots", "--slo", "ttft=500ms",
            *(a for p in policies for a in ("--policy", p)), *flags, "--out", str(tmp_path / way),
        )  # fmt: skip
    for policy in policies:
        first = _read(tmp_path / "one" / policy / "summary.json")
        assert first["simulated_requests"] == 60
        for way in ("pool", "ray"):
            assert _read(tmp_path / way / policy / "summary.json") == first, (way, policy)
    for way in ways:
        assert "least_request" in (tmp_path / way / "comparison.md").read_text()


def test_plan_rate_searches_and_pareto_agree_on_a_pool_and_on_ray(
    tmp_path: Path, ray_address: str
) -> None:
    search = ["plan", "--model", "llama-3.1-8b", "--gpu", "H100", "--gpu", "A100", "--tp", "1",
              "--workload", PLAN_WORKLOAD, *SLO, "--rate", "20", "--num-requests", "40",
              "--max-probes", "4", "--probe-duration", "2", "--pareto", "--pareto-sizes", "1,2",
              "--sim-duration", "5"]  # fmt: skip
    for way, flags in (WAYS | {"ray": ["--ray", ray_address]}).items():
        _kiloserve(*search, *flags, "--out", str(tmp_path / way))
    plan = _read(tmp_path / "one" / "plan.json")
    assert len(plan["capacities"]) == 2 and len(plan["pareto"]) == 2
    for way in ("pool", "ray"):
        assert _read(tmp_path / way / "plan.json") == plan, way


def test_plan_stages_agree_on_a_pool_and_on_ray(tmp_path: Path, ray_address: str) -> None:
    """``run_stages`` (what ``plan --stages`` runs), on three small stages."""
    slo = parse_percentile_slo("ttft_p95=300ms,tpot_p95=40ms")
    candidates = enumerate_candidates(get_model("llama-3.1-8b"), [get_gpu("H100")], tps=[1])
    _write_sweep(tmp_path / "sweep.json")
    capacities = {candidates[0].name: capacity_from_sweep(tmp_path / "sweep.json", slo)}
    ways: dict[str, dict[str, Any]] = {
        "one": {"jobs": 1}, "pool": {"jobs": 2}, "ray": {"ray_address": ray_address}
    }  # fmt: skip
    texts = {}
    for way, kwargs in ways.items():
        stages = run_stages(
            candidates, capacities, lambda c: 2.5, slo=slo, workload_spec=PLAN_WORKLOAD,
            mean_output_tokens=20.0, headroom=1.25, seed=0, duration_s=2.0, policy="default",
            stage_cards=(1, 4, 16), **kwargs,
        )  # fmt: skip
        texts[way] = [_host_free(s.to_dict()) for s in stages]
    assert [s["num_cards"] for s in texts["one"]] == [1, 4, 16]
    assert all(s["targets_ms"]["ttft_p95"] > 0 for s in texts["one"])
    assert texts["pool"] == texts["one"] and texts["ray"] == texts["one"]


def _write_sweep(path: Path) -> None:
    def row(value: float, req_s: float, ttft_p95: float) -> dict[str, float]:
        return {
            "value": value, "request_throughput": req_s, "output_token_throughput": req_s * 20,
            "tpot_p50_ms": 20.0, "tpot_p95_ms": 25.0, "ttft_p50_ms": ttft_p95 / 2,
            "ttft_p95_ms": ttft_p95, "e2e_p95_ms": 900.0, "error_rate": 0.0,
        }  # fmt: skip

    points = [row(1, 1.0, 100.0), row(4, 4.0, 250.0), row(8, 6.0, 400.0)]
    path.write_text(json.dumps({"schema_version": 1, "parameter": "concurrency", "points": points}))
