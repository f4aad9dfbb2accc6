"""A copy of the package away from this checkout (no ``../shared`` anywhere near it)
still runs the shipped trace workloads: the traces travel as package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]


def test_sim_azure_conv_runs_from_a_package_copy_without_shared(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "src" / "kiloserve", site / "kiloserve", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {k: v for k, v in os.environ.items() if k != "KILOSERVE_TRACES"}
    env["PYTHONPATH"] = str(site)
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "kiloserve", "sim",
        "-c", str(ROOT / "examples" / "cluster-tiny.yaml"),
        "--workload", "azure-conv", "--num-requests", "40", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path.parent / "shared").exists()
    summary = orjson.loads((out / "default" / "summary.json").read_bytes())
    assert summary["simulated_requests"] == 40
    assert summary["workload"]["name"].startswith("azure-conv")
