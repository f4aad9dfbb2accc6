"""``kiloserve plan`` end to end: simulated rate search, sweep-file input, plan.json,
``--verify`` and ``--pareto`` (small, fast settings)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiloserve.cli import main

WORKLOAD = "synthetic:input=fixed(200),output=fixed(20)"
SMALL = ["--model", "llama-3.1-8b", "--gpu", "H100", "--tp", "1", "--workload", WORKLOAD]
SLO = ["--slo", "ttft_p95=300ms,tpot_p95=40ms"]


def _plan(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "plan.json").read_text())
    return data


def _sweep(path: Path) -> Path:
    def row(value: float, req_s: float, ttft_p95: float) -> dict[str, float]:
        return {
            "value": value, "request_throughput": req_s, "output_token_throughput": req_s * 20,
            "tpot_p50_ms": 20.0, "tpot_p95_ms": 25.0, "ttft_p50_ms": ttft_p95 / 2,
            "ttft_p95_ms": ttft_p95, "e2e_p95_ms": 900.0, "error_rate": 0.0,
        }  # fmt: skip

    points = [row(1, 1.0, 100.0), row(4, 4.0, 250.0), row(8, 6.0, 400.0)]
    path.write_text(json.dumps({"schema_version": 1, "parameter": "concurrency", "points": points}))
    return path


def test_plan_simulated_rate_search(tmp_path: Path) -> None:
    args = ["plan", *SMALL, *SLO, "--rate", "40", "--num-requests", "60", "--max-probes", "6"]
    args += ["--probe-duration", "2"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    plan = _plan(tmp_path)
    assert plan["model"] == "Llama-3.1-8B"
    assert plan["workload"]["mean_input_tokens"] == 200
    assert plan["workload"]["mean_output_tokens"] == 20
    (ledger,) = plan["candidates"]
    assert ledger["fits"] and ledger["gpu"] == "H100-SXM" and ledger["kv_tokens"] > 100_000
    best = plan["recommended"]
    capacity = plan["capacities"]["H100-SXM TP1 bf16"]
    assert capacity["source"] == "simulated"
    assert 1 <= len(capacity["probes"]) <= 6
    per_replica = best["per_replica_rps"]
    assert per_replica > 0
    # The chosen rate is the highest probe that met the SLO, and every failing probe
    # names a violated objective.
    passing = [p["rate_rps"] for p in capacity["probes"] if p["is_passing"]]
    assert per_replica == max(passing)
    assert all(p["violations"] for p in capacity["probes"] if not p["is_passing"])
    assert best["num_replicas"] == math.ceil(40 / per_replica * 1.25 - 1e-9)
    assert best["num_cards"] == best["num_replicas"]
    assert best["cost_per_hour"] == pytest.approx(best["num_cards"] * 2.5)
    assert plan["command"][:2] == ["kiloserve", "plan"]


def test_plan_from_sweep_file(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "sweep.json")
    args = ["plan", *SMALL, *SLO, "--rate", "20", "--price", "H100=3", "--headroom", "1.2"]
    assert main([*args, "--sweep-file", str(sweep), "--out", str(tmp_path / "out")]) == 0
    best = _plan(tmp_path / "out")["recommended"]
    # Highest sweep point within ttft_p95 <= 300 ms: 4 req/s -> ceil(20 / 4 x 1.2) = 6.
    assert best["per_replica_rps"] == 4.0
    assert best["capacity_source"] == f"sweep:{sweep}"
    assert best["num_replicas"] == 6
    assert best["cost_per_hour"] == pytest.approx(18.0)
    assert best["cost_per_million_output_tokens"] == pytest.approx(18.0 / (20 * 20 * 3600) * 1e6)


def test_sweep_file_needs_one_candidate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _sweep(tmp_path / "sweep.json")
    args = ["plan", "--model", "llama-3.1-8b", "--gpu", "H100", "--workload", WORKLOAD, *SLO]
    rc = main([*args, "--rate", "5", "--sweep-file", str(sweep), "--out", str(tmp_path)])
    assert rc == 2
    assert "narrow --gpu/--tp/--quant" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()


def test_plan_verify_and_pareto(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "sweep.json")
    args = ["plan", *SMALL, *SLO, "--rate", "6", "--sweep-file", str(sweep), "--verify"]
    args += ["--pareto", "--pareto-sizes", "1,2", "--sim-duration", "10"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    plan = _plan(tmp_path / "out")
    assert plan["recommended"]["num_replicas"] == 2  # ceil(6 / 4 x 1.25)
    verify = plan["verify"]
    assert verify["num_gpus"] == 2 and verify["rate_rps"] == 6
    assert verify["simulated_requests"] == 200  # at least MIN_NUM_REQUESTS
    assert 0.0 <= verify["slo_attainment"] <= 1.0
    assert verify["is_slo_met"] == (not verify["violations"])
    rows = plan["pareto"]
    assert [r["num_gpus"] for r in rows] == [1, 2]
    # scaled load: each size at replicas x 4 req/s / 1.25 headroom
    assert [r["rate_rps"] for r in rows] == pytest.approx([3.2, 6.4])
    assert all(r["cost_per_request"] > 0 and r["ttft_p95_ms"] > 0 for r in rows)
    assert any(r["is_pareto"] for r in rows)
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0


def test_plan_cli_process(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "sweep.json")
    cmd = [sys.executable, "-m", "kiloserve", "plan", *SMALL, *SLO, "--rate", "20"]
    cmd += ["--sweep-file", str(sweep), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Memory ledger" in proc.stdout and "cheapest first" in proc.stdout
    assert _plan(tmp_path / "out")["recommended"]["num_replicas"] == 7  # ceil(6.25)


def test_plan_bad_slo_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", *SMALL, "--slo", "tpot_p95=40ms", "--rate", "5", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "must bound ttft or e2e" in capsys.readouterr().err


def test_plan_unknown_policy_fails_before_searching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", *SMALL, *SLO, "--rate", "5", "--policy", "nope", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "unknown --policy 'nope'" in capsys.readouterr().err


def test_plan_dedupes_aliases(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path / "sweep.json")
    args = ["plan", *SMALL, "--gpu", "H100-SXM", "--quant", "BF16", "--quant", "bf16", *SLO]
    assert main([*args, "--rate", "4", "--sweep-file", str(sweep), "--out", str(tmp_path)]) == 0
    plan = _plan(tmp_path)
    assert [(c["gpu"], c["tp"], c["quant"]) for c in plan["candidates"]] == [
        ("H100-SXM", 1, "bf16")
    ]


async def test_plan_from_a_sweep_measured_on_a_twin(tmp_path: Path) -> None:
    """bench --sweep against a real engine twin (roofline H100) writes sweep.json; the
    planner sizes the cluster from that file's highest point within the SLO."""
    from kiloserve.bench.sweep import run_sweep, write_sweep
    from kiloserve.engine.server import TwinServer
    from kiloserve.engine.twin import TwinConfig
    from kiloserve.workload import load_workload

    def make_workload(index: int, value: float) -> Any:
        return load_workload(WORKLOAD, seed=index, num_requests=8)

    cfg = TwinConfig(gpu="H100", model="llama-3.1-8b", port=0)
    async with TwinServer(cfg) as twin:
        points = await run_sweep(
            twin.url, "Llama-3.1-8B", make_workload, "concurrency", [1, 4], tmp_path / "sweep"
        )
    write_sweep(tmp_path / "sweep", "concurrency", points, {"model": "Llama-3.1-8B"})
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    within = [p for p in sweep["points"] if p["ttft_p95_ms"] <= 300 and p["tpot_p95_ms"] <= 40]
    assert within, sweep["points"]
    expected = max(p["request_throughput"] for p in within)
    args = ["plan", *SMALL, *SLO, "--rate", "50", "--out", str(tmp_path / "out")]
    assert main([*args, "--sweep-file", str(tmp_path / "sweep" / "sweep.json")]) == 0
    best = _plan(tmp_path / "out")["recommended"]
    assert best["per_replica_rps"] == pytest.approx(expected)
    assert best["num_replicas"] == math.ceil(50 / expected * 1.25 - 1e-9)


def test_plan_stages_writes_the_five_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stages: five stages (1 -> 1,024 cards), each simulated at the load its cards
    sustain; stages.md and stages.json agree with the capacity in the sweep file."""
    sweep = _sweep(tmp_path / "sweep.json")
    args = ["plan", *SMALL, *SLO, "--rate", "20", "--sweep-file", str(sweep), "--stages"]
    assert main([*args, "--sim-duration", "1", "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "stages.json").read_text())
    stages = data["stages"]
    assert [s["num_cards"] for s in stages] == [1, 4, 32, 256, 1024]
    for stage in stages:
        replicas = stage["num_cards"]  # TP1
        assert stage["deployment"]["num_replicas"] == replicas
        assert stage["rate_rps"] == pytest.approx(replicas * 4.0 / 1.25)  # capacity / headroom
        targets = stage["targets_ms"]
        assert 0 < targets["ttft_p50"] <= targets["ttft_p95"]
        assert 0 < targets["tpot_p50"] <= targets["tpot_p95"]
        assert all(m["reason"] for m in stage["must_dos"] + stage["indicators"])
    texts = [" | ".join(m["text"] for m in s["must_dos"]) for s in stages]
    assert "gateway" not in texts[0] and "load-aware routing" in texts[1]
    assert "etcd registry" not in texts[1] and "etcd registry" in texts[2]
    assert "gateway workers" in texts[4]  # 3,277 req/s of 20-token streams: 2.8 cores
    md = (tmp_path / "out" / "stages.md").read_text()
    assert md.count("## Stage ") == 5 and "The target, 20 req/s, is within stage 3." in md
    printed = capsys.readouterr().out
    assert "## Stage 5: 1,024 card(s)" in printed and "stages.json" in printed
