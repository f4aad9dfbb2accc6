"""Usable CPUs (affinity capped by the cgroup's CPU quota) and ``--workers auto``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kiloserve import cpus
from kiloserve.cpus import cgroup_cpu_limit, usable_cpus
from kiloserve.gateway import cli
from kiloserve.gateway.config import parse_gateway_config


def _v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text + "\n")
    return root


def _v1(root: Path, quota: str, period: str = "100000") -> Path:
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(period + "\n")
    return root


@pytest.mark.parametrize(
    ("kind", "text", "limit"),
    [
        ("v2", "max 100000", None),
        ("v2", "200000 100000", 2.0),
        ("v2", "150000 100000", 1.5),
        ("v2", "garbage", None),
        ("v1", "-1", None),
        ("v1", "50000", 0.5),
        ("v1", "400000", 4.0),
        ("none", "", None),
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, kind: str, text: str, limit: float | None) -> None:
    root = {"v2": _v2, "v1": _v1}[kind](tmp_path, text) if kind != "none" else tmp_path
    assert cgroup_cpu_limit(root) == limit


@pytest.mark.parametrize(
    ("cores", "cpu_max", "expected"),
    [(8, "max 100000", 8), (8, "200000 100000", 2), (8, "150000 100000", 2),
     (2, "800000 100000", 2), (8, "20000 100000", 1)],
)  # fmt: skip
def test_usable_cpus_is_the_affinity_capped_by_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, cpu_max: str, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert usable_cpus(_v2(tmp_path, cpu_max)) == expected


def test_workers_auto_in_the_config_and_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(6)))
    monkeypatch.setattr(cpus, "CGROUP_ROOT", _v2(tmp_path, "300000 100000"))
    assert parse_gateway_config({"workers": "auto"}).workers == 3
    assert parse_gateway_config({}).workers == 3  # the default: one per usable CPU
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.build_config(parser.parse_args(["--workers", "auto"])).workers == 3
    assert cli.build_config(parser.parse_args(["--workers", "2"])).workers == 2
    assert cli.build_config(parser.parse_args(["--workers", "1"])).workers == 1
    assert cli.build_config(parser.parse_args([])).workers == 3


def test_workers_flag_names_what_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--workers", "many"])
    assert "must be a whole number or 'auto', got 'many'" in capsys.readouterr().err
