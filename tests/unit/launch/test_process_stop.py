"""Stopping children: a child that ignores SIGTERM is killed, and a cluster stops every
process even when stopping one of them fails (real child processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config
from kiloserve.launch.process import ChildProcess

# Ignores SIGTERM, says so on stdout (the log), then sleeps.
STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def _child(tmp_path: Path, name: str, code: str = STUBBORN) -> ChildProcess:
    child = ChildProcess(
        name=name,
        argv=[sys.executable, "-c", code],
        url="http://127.0.0.1:9",
        log_path=tmp_path / f"{name}.log",
    )
    child.start()
    deadline = time.monotonic() + 10
    while "ready" not in child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return child


def test_a_child_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    child = _child(tmp_path, "stubborn")
    child.stop(grace_s=0.2)
    assert child.proc is not None and child.proc.returncode == -9


class _FailingStop(ChildProcess):
    def stop(self, grace_s: float = 5.0, kill_wait_s: float = 30.0) -> None:
        super().stop(grace_s, kill_wait_s)
        raise subprocess.TimeoutExpired(list(self.argv), grace_s)


def test_cluster_stops_every_engine_when_the_gateway_stop_fails(tmp_path: Path) -> None:
    cfg = parse_cluster_config(
        {"name": "c", "backends": [{"name": "b", "gpu": "L40S", "model": "llama-3.1-8b"}]}
    )
    cluster = LocalCluster(cfg, gateway=False, run_dir=tmp_path)
    engines = [_child(tmp_path, f"engine-{i}", "import time\nprint('ready', flush=True)\n"
                      "time.sleep(120)\n") for i in range(2)]  # fmt: skip
    gateway = _FailingStop(
        name="gateway",
        argv=[sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"],
        url="http://127.0.0.1:9",
        log_path=tmp_path / "gateway.log",
    )
    gateway.start()
    cluster.children = engines
    cluster.gateway = gateway
    with pytest.raises(subprocess.TimeoutExpired):
        cluster.stop()
    assert [c.exit_code() for c in engines] == [-15, -15]
