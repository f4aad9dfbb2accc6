"""``kiloserve.sim.sweep.run_all``: the process pool, the in-process path, bad input."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from kiloserve.errors import ConfigError
from kiloserve.sim.sweep import (
    WALL_CLOCK_KEYS,
    add_sweep_arguments,
    default_jobs,
    run_all,
    without_wall_clock,
)


def square_with_pid(value: int) -> tuple[int, int]:
    return value * value, os.getpid()


def test_jobs_2_runs_in_other_processes_and_keeps_the_order() -> None:
    results = run_all(square_with_pid, [3, 1, 2, 5], jobs=2)
    assert [r[0] for r in results] == [9, 1, 4, 25]
    assert os.getpid() not in {r[1] for r in results}


@pytest.mark.skipif(default_jobs() < 2, reason="one core: the default runs in process")
def test_default_uses_a_process_pool_on_several_cores() -> None:
    results = run_all(square_with_pid, [1, 2])
    assert os.getpid() not in {r[1] for r in results}


def test_jobs_1_is_the_plain_loop_in_this_process() -> None:
    results = run_all(square_with_pid, [4, 6], jobs=1)
    assert results == [(16, os.getpid()), (36, os.getpid())]


def test_jobs_below_1_is_an_error() -> None:
    with pytest.raises(ConfigError, match="--jobs must be >= 1"):
        run_all(square_with_pid, [1], jobs=0)


def test_ray_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: import fails
    with pytest.raises(ConfigError, match=r"kiloserve\[ray\]"):
        run_all(square_with_pid, [1], ray_address="127.0.0.1:1")


def test_without_wall_clock_drops_only_the_host_keys() -> None:
    summary = {key: 1.0 for key in WALL_CLOCK_KEYS} | {"ttft_ms": {"p95": 3.0}}
    assert without_wall_clock(summary) == {"ttft_ms": {"p95": 3.0}}


def test_the_jobs_flag_takes_only_whole_numbers_from_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_sweep_arguments(parser)
    assert parser.parse_args(["--jobs", "3", "--ray", "auto"]).jobs == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--jobs", bad])
        assert "must be a whole number >= 1" in capsys.readouterr().err
