"""``benchmarks/handler_work.py`` runs: both policies' rows, every stage measured, and
the ratio line (each request of the whole path was routed to a backend: an empty
decision would end the run with an error)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_handler_work_measures_both_policies() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/handler_work.py"), "--requests", "300",
         "--rounds", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(re.findall(r"^(round_robin|default)((?:\s+[\d.]+){6})$", out.stdout, re.M))
    assert rows.keys() == {"round_robin", "default"}, out.stdout
    for cells in rows.values():
        assert all(float(v) > 0 for v in cells.split()), out.stdout
    assert re.search(r"^default / round_robin, whole path, same run: [\d.]+x$", out.stdout, re.M)
