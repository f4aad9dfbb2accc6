"""``benchmarks/gateway_overhead.py`` runs end to end: the gateway and every installed
Rust router (``make peer-routers``; ``make test`` installs them) serve the same load
with no failed request, and the report prints the same-run ratios issue 16 asks for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from peer_routers import PINS, find_routers  # noqa: E402

pytestmark = pytest.mark.slow

ROW = re.compile(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)$", re.M)


def test_gateway_overhead_measures_the_gateway_beside_the_peer_routers() -> None:
    routers, missing = find_routers()
    cmd = [
        sys.executable, str(REPO / "benchmarks/gateway_overhead.py"), "--num-requests", "200",
        "--num-streams", "20", "--chunks", "5", "--no-loop-baseline", "--before-src", str(REPO),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = {m[0]: m for m in ROW.findall(out.stdout)}
    assert {"direct", "gateway", "gw-before", *(r.name for r in routers)} <= rows.keys(), out.stdout
    assert re.search(r"^against --before-src, same run: CPU per request [\d.]+x, per relayed "
                     r"chunk [\d.]+x", out.stdout, re.M)  # fmt: skip
    assert all(row[-1] == "0" for row in rows.values()), out.stdout  # no failed request
    for r in routers:
        cpu_per_request = float(rows[r.name][5])
        assert cpu_per_request > 0, out.stdout  # its own process was measured
        assert re.search(rf"^{r.name} reference: .* per request, .* per chunk$", out.stdout, re.M)
    for line in missing:
        assert line in out.stdout
    if "vllm-router" in rows:
        assert re.search(r"^issue 16, same run: gateway CPU per request [\d.]+x", out.stdout, re.M)


def test_every_pinned_router_is_found_or_named_missing() -> None:
    routers, missing = find_routers()
    assert sorted([r.name for r in routers] + [m.split(":")[0] for m in missing]) == sorted(PINS)
    assert all("make peer-routers" in m for m in missing)
