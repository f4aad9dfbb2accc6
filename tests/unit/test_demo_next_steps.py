"""``make demo`` ends with where to look next, and the command it suggests runs."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kiloserve.cli import main
from kiloserve.demo import REPO, TRY_COMMAND, next_steps
from kiloserve.launch.config import load_cluster_config

CLUSTER = REPO / "examples" / "cluster.yaml"


def test_next_steps_name_the_report_the_dashboard_and_a_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)  # where `make demo` runs
    lines = next_steps(REPO / "runs" / "demo", load_cluster_config(CLUSTER), CLUSTER)
    assert lines == [
        "where to look next:",
        "  report:    runs/demo/comparison.md "
        "(per policy: runs/demo/<policy>/summary.md and plots)",
        "  dashboard: kiloserve up -c examples/cluster.yaml --open  "
        "(then http://127.0.0.1:8000/dashboard)",
        f"  try:       {TRY_COMMAND}",
    ]


def test_next_steps_outside_the_repo_show_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_cluster_config(CLUSTER)
    cfg = cfg.model_copy(update={"gateway": cfg.gateway.model_copy(update={"port": 0})})
    lines = next_steps(Path("/elsewhere/demo"), cfg, CLUSTER)
    assert lines[1].startswith("  report:    /elsewhere/demo/comparison.md ")
    assert lines[2] == (
        f"  dashboard: kiloserve up -c {CLUSTER} --open  (then the dashboard URL it prints)"
    )


def test_the_suggested_command_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    argv = shlex.split(TRY_COMMAND)
    assert argv[0] == "kiloserve"
    argv = argv[1:]
    argv[argv.index("--num-requests") + 1] = "200"  # the same command, smaller
    argv[argv.index("--out") + 1] = str(tmp_path / "sim")
    assert main([*argv, "--no-plots"]) == 0
    assert (tmp_path / "sim" / "comparison.md").is_file()
