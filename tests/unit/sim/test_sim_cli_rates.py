"""``kiloserve sim`` with several ``--rate`` flags: one run per (rate, policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from kiloserve.cli import main
from kiloserve.sim.sweep import without_wall_clock

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "examples" / "cluster-tiny.yaml")
WORKLOAD = "synthetic:input=uniform(32,200),output=uniform(8,48)"


def _sim(out: Path, *flags: str) -> None:
    code = main(["sim", "-c", TINY, "--workload", WORKLOAD, "--num-requests", "40",
                 "--no-plots", "--out", str(out), *flags])  # fmt: skip
    assert code == 0


def _summary(folder: Path) -> dict[str, Any]:
    data = orjson.loads((folder / "summary.json").read_bytes())
    assert isinstance(data, dict)
    return data


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary less the host's wall clock and the recorded command line."""
    return {k: v for k, v in without_wall_clock(summary).items() if k != "command"}


def test_two_rates_give_a_summary_per_rate_and_comparisons(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    _sim(out, "--rate", "2", "--rate", "8", "--policy", "round_robin",
         "--policy", "least_request", "--jobs", "1")  # fmt: skip
    assert {p.name for p in out.iterdir()} == {"rate-2", "rate-8", "comparison.md",
                                               "comparison.json"}  # fmt: skip
    throughput = {}
    for rate in ("2", "8"):
        for policy in ("round_robin", "least_request"):
            summary = _summary(out / f"rate-{rate}" / policy)
            assert summary["simulated_requests"] == 40
            throughput[rate, policy] = summary["request_throughput"]
        at_rate = (out / f"rate-{rate}" / "comparison.md").read_text()
        assert f"at rate-{rate}" in at_rate and "least_request" in at_rate
    # the arrivals of 40 requests at 8 req/s span about a quarter of those at 2 req/s
    for policy in ("round_robin", "least_request"):
        assert throughput["8", policy] > 2.5 * throughput["2", policy]
    table = (out / "comparison.md").read_text()
    assert "rates and policies" in table
    for label in ("rate-2/round_robin", "rate-8/least_request"):
        assert label in table
    assert set(orjson.loads((out / "comparison.json").read_bytes())) == {
        "rate-2/round_robin", "rate-2/least_request", "rate-8/round_robin",
        "rate-8/least_request",
    }  # fmt: skip


def test_each_rate_of_a_pool_run_equals_its_single_rate_run(tmp_path: Path) -> None:
    _sim(tmp_path / "multi", "--rate", "3", "--rate", "6", "--policy", "round_robin",
         "--jobs", "2")  # fmt: skip
    for rate in ("3", "6"):
        single = tmp_path / f"single-{rate}"
        _sim(single, "--rate", rate, "--policy", "round_robin")
        # one rate: today's layout, DIR/<policy>, no rate folder and no comparison
        assert {p.name for p in single.iterdir()} == {"round_robin"}
        assert _comparable(_summary(single / "round_robin")) == _comparable(
            _summary(tmp_path / "multi" / f"rate-{rate}" / "round_robin")
        )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate", "4", "--rate", "4.0"], "--rate given twice"),
        (["--rate", "4", "--rate", "-1"], "--rate must be a positive"),
        (["--rate", "0"], "--rate must be a positive"),
    ],
)
def test_bad_rates_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code = main(["sim", "-c", TINY, "--workload", WORKLOAD, "--num-requests", "5",
                 "--out", str(tmp_path), *flags])  # fmt: skip
    assert code == 2
    assert message in capsys.readouterr().err
