"""``kiloserve sim`` writes the report files."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kiloserve.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_sim_cli_writes_reports_per_policy_and_a_comparison(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    code = main([
        "sim", "-c", str(ROOT / "examples" / "cluster.yaml"),
        "--workload", "synthetic:input=uniform(32,300),output=uniform(8,64)",
        "--rate", "6", "--num-requests", "60", "--policy", "round_robin",
        "--policy", "least_request", "--slo", "ttft=500ms", "--records",
        "--fault", "t=3,backend=h100-llama-0,kind=slow,factor=2", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    for policy in ("round_robin", "least_request"):
        folder = out / policy
        names = {p.name for p in folder.iterdir()}
        assert {"summary.json", "summary.md", "requests.jsonl", "routing.csv"} <= names
        assert {"backend_p95.png", "backend_timeseries.png"} <= names
        summary = orjson.loads((folder / "summary.json").read_bytes())
        assert summary["simulated_requests"] == 60
        assert summary["sim_wall_s"] > 0
        assert 0 < summary["arrival_span_s"] < summary["simulated_duration_s"]
        assert "goodput" in summary
        assert set(summary["backend_timeseries"]["kv_usage"]) >= {"h100-llama-0"}
        assert "## Simulation" in (folder / "summary.md").read_text()
    assert "least_request" in (out / "comparison.md").read_text()


def test_sim_cli_rejects_a_closed_loop_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([
        "sim", "-c", str(ROOT / "examples" / "cluster-tiny.yaml"),
        "--workload", "synthetic:input=32,output=8", "--num-requests", "5",
        "--out", str(tmp_path),
    ])  # fmt: skip
    assert code == 2
    assert "open-loop" in capsys.readouterr().err
