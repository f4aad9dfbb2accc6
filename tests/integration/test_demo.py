"""``python -m kiloserve.demo`` (what ``make demo`` runs), shortened by its env knobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiloserve.demo import TRY_COMMAND

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_ends_with_where_to_look_next(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = os.environ | {
        "KILOSERVE_DEMO_REQUESTS": "6",
        "KILOSERVE_DEMO_RATE": "30",
        "KILOSERVE_DEMO_OUT": str(out),
        "COLUMNS": "200",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "kiloserve.demo"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    tail = (proc.stdout + proc.stderr).rstrip().splitlines()[-4:]
    assert tail[0] == "where to look next:"
    assert tail[1].startswith(f"  report:    {out / 'comparison.md'} ")
    assert (out / "comparison.md").is_file()
    assert tail[2].startswith("  dashboard: kiloserve up -c examples/cluster.yaml --open")
    assert "http://127.0.0.1:8000/dashboard" in tail[2]
    assert tail[3] == f"  try:       {TRY_COMMAND}"
