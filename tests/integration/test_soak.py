"""The 2-minute soak CI runs (S3.7, issue 15): ``benchmarks/soak.py`` for 2 minutes with
a few streams and a fault every 10 s (kill, hang, stall, errors, slow, thermal in
rotation). Asserts zero user-visible failures and bounded gateway RSS growth. The full
targets (<= 5% after warm-up over 30 min) are the benchmark's; a 2-minute run with few
streams is still warming up (the prefix index fills for minutes), so this bound is
looser (docs/chaos.md, "Soak")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RSS_GROWTH_BOUND = 0.25  # measured +7.9% (12 streams, 75 s); warm-up growth is in it


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_short_soak_has_no_user_visible_failures(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [
        sys.executable, str(REPO / "benchmarks" / "soak.py"), "--streams", "12",
        "--minutes", "2", "--fault-every-s", "10", "--report-every-s", "15",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    print(proc.stdout)
    assert out.exists(), proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["user_visible_failures"] == 0, (result["failure_reasons"], proc.stdout)
    assert len(result["faults"]) >= 6, result["faults"]  # the whole rotation, thermal too
    assert result["requests"] > 200
    samples = result["samples"]
    assert len(samples) == 8  # every 15 s
    growth = samples[-1]["rss_mib"] / samples[0]["rss_mib"] - 1.0
    assert growth <= RSS_GROWTH_BOUND, proc.stdout
    assert max(s["fds"] for s in samples) < 500, proc.stdout
