"""``benchmarks/server_floor.py`` runs: every front-door candidate answers the
backend's completion (its own check, before any measurement) and the table lists each
candidate in both modes with no failed request."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_server_floor_measures_every_candidate() -> None:
    pytest.importorskip("httptools")
    pytest.importorskip("granian")
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/server_floor.py"),
            "--num-requests",
            "200",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(
        r"^(aiohttp|aiohttp-lowlevel|httptools|granian)\s+(answer|proxy)\s+([\d.]+)\s.*\s(\d+)\s+"
        r"([\d.]+)x$",
        out.stdout,
        re.MULTILINE,
    )
    assert len(rows) == 8, out.stdout
    assert {(kind, mode) for kind, mode, *_ in rows} == {
        (k, m)
        for k in ("aiohttp", "aiohttp-lowlevel", "httptools", "granian")
        for m in ("answer", "proxy")
    }
    assert all(errors == "0" for *_, errors, _ in rows), out.stdout
    assert all(kind != "aiohttp" or ratio == "1.00" for kind, _, _, _, ratio in rows)
