"""`kiloserve up` starts a cluster, reports crashes, and leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kiloserve.errors import ConfigError, DoesNotFitError
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config

TWO_TWINS = {
    "backends": [
        {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b"},
        {"name": "a100", "gpu": "a100", "model": "LLAMA-3.1-8B", "group": "rack-b"},
    ]
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not alive for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_cluster_starts_healthy_and_stops_cleanly(tmp_path: Path) -> None:
    cfg = parse_cluster_config(TWO_TWINS)
    with LocalCluster(cfg, gateway=False, run_dir=tmp_path) as cluster:
        assert [b.name for b in cluster.backends] == ["h100", "a100"]
        assert cluster.backends[0].kv_capacity_tokens > cluster.backends[1].kv_capacity_tokens // 2
        for b in cluster.backends:
            with urllib.request.urlopen(b.url + "/health", timeout=5) as resp:
                assert resp.status == 200
        pids = cluster.pids()
        assert len(pids) == 2
    assert not [p for p in pids if _alive(p)]


def test_crashed_twin_is_reported(tmp_path: Path) -> None:
    cfg = parse_cluster_config(TWO_TWINS)
    with LocalCluster(cfg, gateway=False, run_dir=tmp_path) as cluster:
        victim = cluster.children[1]
        req = urllib.request.Request(
            victim.url + "/admin/faults",
            data=b'{"crash": true}',
            headers={"content-type": "application/json"},
        )
        with contextlib.suppress(OSError):  # the crash may race the reply
            urllib.request.urlopen(req, timeout=5).close()
        deadline = time.monotonic() + 10
        crashed: list[tuple[str, int]] = []
        while not crashed and time.monotonic() < deadline:
            crashed = cluster.crashed()
            time.sleep(0.1)
        assert [name for name, _ in crashed] == ["a100"]
        assert cluster.crashed() == []  # reported once


def test_model_that_does_not_fit_fails_before_starting(tmp_path: Path) -> None:
    cfg = parse_cluster_config({"backends": [{"name": "big", "gpu": "H100", "model": "qwen2-72b"}]})
    cluster = LocalCluster(cfg, gateway=False, run_dir=tmp_path)
    with pytest.raises(DoesNotFitError, match="--tp"):
        cluster.start()
    assert cluster.children == []


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown key 'modle'"):
        parse_cluster_config({"backends": [{"name": "a", "gpu": "H100", "modle": "x"}]})


def test_up_command_runs_until_signal_and_cleans_up(tmp_path: Path) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("backends:\n  - {name: one, gpu: H100, model: llama-3.1-8b}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiloserve",
            "up",
            "-c",
            str(cfg),
            "--no-gateway",
            "--run-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 60
    while "Ctrl-C" not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert "KV capacity" in seen and "one" in seen, seen
    children = [
        int(c)
        for c in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    assert children, "the twin should run as a child of `kiloserve up`"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, seen + out
    assert [c for c in children if _alive(c)] == []
