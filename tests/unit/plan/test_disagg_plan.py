"""``kiloserve plan --disagg``: layouts, ranking, the crossover search (with a fake
simulation where the logic is pure) and the real comparison and CLI on a tiny cluster."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kiloserve.cli import main
from kiloserve.errors import ConfigError
from kiloserve.plan.capacity import parse_percentile_slo
from kiloserve.plan.disagg import (
    DisaggSetup,
    Layout,
    LayoutRun,
    compare_layouts,
    crossover_block,
    crossover_sweeps,
    find_crossover,
    layout_cluster,
    layouts_for,
    parse_list,
    prompt_grid,
    rank_rows,
)

SLO = parse_percentile_slo("ttft_p95=1s,tpot_p95=50ms")
SETUP = DisaggSetup("H100", "llama-3.1-8b", 1, "bf16", SLO, duration_s=5.0)
LAYOUT_KEYS = {
    "name", "prefill", "decode", "both", "kv_cpu_gib", "goodput_per_gpu", "ttft_ms", "tpot_ms",
    "kv_transfer_ms", "rank", "num_gpus", "slo_attainment", "rate_rps", "is_slo_met",
}  # fmt: skip
SWEEP = "synthetic:input=fixed(200),output=fixed(20)"


def _summary(attainment: float, ttft_p95: float = 100.0, tpot_p95: float = 20.0) -> dict[str, Any]:
    return {
        "slo_attainment": attainment,
        "error_rate": 0.0,
        "ttft_ms": {"mean": ttft_p95 / 2, "p50": ttft_p95 / 2, "p90": ttft_p95, "p95": ttft_p95,
                    "p99": ttft_p95},
        "tpot_ms": {"mean": 10.0, "p50": 10.0, "p90": tpot_p95, "p95": tpot_p95, "p99": tpot_p95},
        "e2e_ms": {"p95": 1000.0},
    }  # fmt: skip


def _prompt(run: LayoutRun) -> int | None:
    m = re.search(r"input=fixed\((\d+)\)", run.workload_spec)
    return int(m.group(1)) if m else None


def fake_runner(run: LayoutRun) -> Mapping[str, Any]:
    """Colocated misses TPOT from 4,096-token prompts and above 8 req/s; P/D layouts
    keep 90% (the 1:1 split 95% at long prompts): a crossover at 4,096 tokens and 12 req/s."""
    prompt = _prompt(run)
    if not run.layout.is_disagg:
        bad = (prompt is not None and prompt >= 4096) or (prompt is None and run.rate_rps > 8)
        return _summary(0.5 if bad else 1.0, tpot_p95=80.0 if bad else 20.0)
    best = run.layout.prefill == run.layout.decode and prompt is not None and prompt >= 4096
    return _summary(0.95 if best else 0.9)


def test_layouts_split_the_same_replicas_by_ratio() -> None:
    layouts = layouts_for(12)
    names = [lay.name for lay in layouts]
    assert names == ["colocated", "6P+6D", "4P+8D", "3P+9D", "2P+10D", "8P+4D",
                     "colocated+cpu64", "colocated+cpu256"]  # fmt: skip
    assert all(lay.num_replicas == 12 for lay in layouts)
    assert [lay.ratio for lay in layouts[1:6]] == ["1:1", "1:2", "1:3", "1:4", "2:1"]
    assert [lay.kv_cpu_gib for lay in layouts] == [0, 0, 0, 0, 0, 0, 64, 256]
    assert not layouts[0].is_disagg and layouts[1].is_disagg and not layouts[-1].is_disagg


def test_layouts_drop_ratios_that_round_to_the_same_counts() -> None:
    # 5 replicas: 1:1 -> 3P+2D (2.5 rounds half up), 1:2 -> 2P+3D, 1:3 and 1:4 -> 1P+4D,
    # 2:1 -> 3P+2D again
    names = [lay.name for lay in layouts_for(5, cpu_gibs=())]
    assert names == ["colocated", "3P+2D", "2P+3D", "1P+4D"]
    assert [lay.name for lay in layouts_for(1, cpu_gibs=())] == ["colocated"]
    with pytest.raises(ConfigError, match="at least one replica"):
        layouts_for(0)
    with pytest.raises(ConfigError, match="> 0 GiB"):
        layouts_for(4, cpu_gibs=[0])


def test_layout_cluster_lines_carry_roles_and_tiers() -> None:
    cluster = layout_cluster(SETUP, Layout("2P+3D", 2, 3, 0, ratio="2:3"))
    lines = {line.name: line for line in cluster.backends}
    assert set(lines) == {"prefill", "decode"}
    assert (lines["prefill"].role, lines["prefill"].count) == ("prefill", 2)
    assert (lines["decode"].role, lines["decode"].count) == ("decode", 3)
    assert lines["decode"].kv_link == "network"
    tiered = layout_cluster(SETUP, Layout("colocated+cpu64", 0, 0, 4, kv_cpu_gib=64.0))
    (line,) = tiered.backends
    assert (line.role, line.count, line.kv_cpu_gib) == ("both", 4, 64.0)


def test_ranking_follows_goodput_per_gpu_then_headroom() -> None:
    layouts = layouts_for(4, ratios=[(1, 1), (1, 3)], cpu_gibs=())
    attainment = {"colocated": 0.8, "2P+2D": 1.0, "1P+3D": 1.0}
    ttft = {"colocated": 900.0, "2P+2D": 600.0, "1P+3D": 300.0}

    def runner(run: LayoutRun) -> Mapping[str, Any]:
        return _summary(attainment[run.layout.name], ttft_p95=ttft[run.layout.name])

    rows = compare_layouts(SETUP, layouts, SWEEP, 8.0, runner=runner, jobs=1)
    assert [r["name"] for r in rows] == ["1P+3D", "2P+2D", "colocated"]  # tie: more headroom
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert rows[0]["goodput_per_gpu"] == pytest.approx(8.0 * 1.0 / 4)
    assert rows[2]["goodput_per_gpu"] == pytest.approx(8.0 * 0.8 / 4)
    assert rows[2]["kv_transfer_ms"] is None
    shuffled = rank_rows([dict(r) for r in reversed(rows)])
    assert [r["name"] for r in shuffled] == ["1P+3D", "2P+2D", "colocated"]


def _points(pairs: list[tuple[float, float | None]]) -> list[dict[str, Any]]:
    return [
        {"value": float(i), "colocated_goodput_per_gpu": c, "best_pd_goodput_per_gpu": b,
         "best_pd": "1P+3D", "colocated_slo_attainment": 1.0, "best_pd_slo_attainment": 1.0}
        for i, (c, b) in enumerate(pairs)
    ]  # fmt: skip


def test_find_crossover_needs_more_than_the_margin() -> None:
    assert find_crossover(_points([(1.0, 0.5), (1.0, 1.01), (1.0, 1.1)])) == 2
    assert find_crossover(_points([(1.0, 0.5), (1.0, 1.01)])) is None
    assert find_crossover(_points([(1.0, 1.01)]), min_gain=0.0) == 0
    assert find_crossover(_points([(0.0, 0.0), (0.0, 0.2)])) == 1  # colocated serves none
    assert find_crossover(_points([(1.0, None), (0.5, 1.0)])) == 1  # no P/D at a point


def test_crossover_block_says_none_in_range() -> None:
    block = crossover_block("prompt length", "prompt tokens", _points([(1.0, 0.9), (1.0, 1.0)]))
    assert block["crossover"] is None and block["previous"] is None
    assert "none in range (0-1 prompt tokens)" in block["text"]
    found = crossover_block("rate", "req/s", _points([(1.0, 0.9), (1.0, 1.5)]))
    assert (found["crossover"], found["previous"], found["wins"]) == (1.0, 0.0, [1.0])
    assert "first beats colocated at 1 req/s" in found["text"] and "not at 0" in found["text"]
    assert "wins only" not in found["text"]
    # P/D wins in a window (at 1 and 3, not at 2 or 4): said, not hidden
    window = crossover_block("rate", "req/s", _points([(1, 0.9), (1, 2), (1, 1), (1, 2), (1, 0)]))
    assert (window["crossover"], window["wins"]) == (1.0, [1.0, 3.0])
    assert window["text"].endswith("it wins only at 1, 3")


def test_crossover_sweeps_find_prompt_and_rate_crossovers() -> None:
    layouts = layouts_for(4, ratios=[(1, 1), (1, 3)])  # the CPU-tier layouts are not swept
    result = crossover_sweeps(
        SETUP, layouts, "mix:chat=1", 4.0, prompt_lens=[1024, 2048, 4096, 8192],
        rates=[4.0, 8.0, 12.0],
        mean_input_tokens=200.0, output_tokens=20, runner=fake_runner, jobs=1,
    )  # fmt: skip
    by_prompt, by_rate = result["prompt_tokens"], result["rate_rps"]
    assert (by_prompt["crossover"], by_prompt["previous"]) == (4096, 2048)
    assert [p["best_pd"] for p in by_prompt["points"]] == ["2P+2D", "2P+2D", "2P+2D", "2P+2D"]
    assert by_prompt["points"][2]["gain"] == pytest.approx(0.95 / 0.5 - 1)
    assert set(by_prompt["points"][0]["goodput_per_gpu"]) == {"colocated", "2P+2D", "1P+3D"}
    assert (by_rate["crossover"], by_rate["previous"]) == (12.0, 8.0)
    assert by_rate["workload"] == "mix:chat=1" and by_prompt["rate_rps"] == 4.0
    with pytest.raises(ConfigError, match="needs a P/D layout"):
        crossover_sweeps(
            SETUP, layouts_for(1), SWEEP, 4.0, prompt_lens=[256], rates=[4.0],
            mean_input_tokens=200.0, output_tokens=20, runner=fake_runner, jobs=1,
        )  # fmt: skip


def test_grids_and_lists() -> None:
    assert prompt_grid(None, 200, 8192) == [256, 512, 1024, 2048, 4096]
    assert prompt_grid([100.0, 300.0], 20, None) == [100, 300]
    with pytest.raises(ConfigError, match="no crossover prompt length fits"):
        prompt_grid([9000.0], 200, 8192)
    assert parse_list("4, 2,2", "--x", float) == [2.0, 4.0]
    assert parse_list(None, "--x", float) is None
    with pytest.raises(ConfigError, match="--x must be positive"):
        parse_list("0,1", "--x", float)
    with pytest.raises(ConfigError, match="--x must be comma-separated"):
        parse_list("a", "--x", int)


WORKLOAD = "synthetic:input=lognormal(1500,0.5),output=fixed(40)"
PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "H100", "--tp", "1", "--workload", WORKLOAD,
        "--slo", "ttft_p95=1s,tpot_p95=40ms", "--rate", "6"]  # fmt: skip
DISAGG = ["--disagg", "--disagg-replicas", "4", "--disagg-prompt-lens", "256,4096",
          "--disagg-rates", "3,12", "--disagg-cpu-gib", "16", "--sim-duration", "4",
          "--jobs", "1"]  # fmt: skip


def _sweep(path: Path) -> Path:
    """A measured sweep (skips the rate search): 4 req/s per replica within the SLO."""
    point = {"request_throughput": 4.0, "output_token_throughput": 160.0, "tpot_p95_ms": 25.0,
             "ttft_p95_ms": 400.0, "e2e_p95_ms": 2000.0, "error_rate": 0.0}  # fmt: skip
    points = [point | {"value": 4}, point | {"value": 8, "ttft_p95_ms": 5000.0}]
    path.write_text(json.dumps({"schema_version": 1, "parameter": "concurrency", "points": points}))
    return path


def test_plan_disagg_cli_writes_ranked_layouts_and_crossover(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*PLAN, "--sweep-file", str(_sweep(tmp_path / "sweep.json")), *DISAGG]
    assert main([*args, "--out", str(out)]) == 0
    data = json.loads((out / "disagg.json").read_text())
    assert (data["num_gpus"], data["gpu"], data["rate_rps"]) == (4, "H100-SXM", 6.0)
    rows = data["layouts"]
    assert {r["name"] for r in rows} == {"colocated", "2P+2D", "1P+3D", "3P+1D", "colocated+cpu16"}
    assert all(set(r) >= LAYOUT_KEYS for r in rows)
    # the ranking is the goodput per GPU (offered rate x SLO attainment / GPUs), best first
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    goodputs = [r["goodput_per_gpu"] for r in rows]
    assert goodputs == sorted(goodputs, reverse=True) and data["best"] == rows[0]["name"]
    for r in rows:
        assert r["goodput_per_gpu"] == pytest.approx(6.0 * r["slo_attainment"] / 4)
        assert r["prefill"] + r["decode"] + r["both"] == 4 and r["num_gpus"] == 4
        assert r["ttft_ms"]["p95"] > 0 and r["tpot_ms"]["p95"] > 0
        # only P/D layouts move KV between engines
        assert (r["kv_transfer_ms"] is not None) == (r["prefill"] > 0)
        if r["kv_transfer_ms"] is not None:
            assert r["kv_transfer_ms"]["p95"] > 0
    assert len({r["goodput_per_gpu"] for r in rows}) > 1 or len({r["slo_ratio"] for r in rows}) > 1
    for key, values in (("prompt_tokens", [256, 4096]), ("rate_rps", [3.0, 12.0])):
        block = data["crossover"][key]
        assert [p["value"] for p in block["points"]] == values
        assert {"crossover", "previous", "text", "min_gain"} <= set(block)
        assert block["crossover"] is None or block["crossover"] in values
        assert all(p["best_pd"] in {"2P+2D", "1P+3D", "3P+1D"} for p in block["points"])
    text = (out / "disagg.md").read_text()
    assert all(r["name"] in text for r in rows) and "## Crossover over prompt length" in text
    assert data["crossover"]["rate_rps"]["text"] in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--disagg-replicas", "0"], "--disagg-replicas must be >= 1"),
        (["--disagg-rates", "x"], "--disagg-rates must be comma-separated"),
        (["--disagg-prompt-lens", "200000"], "no crossover prompt length fits"),
    ],
)
def test_plan_disagg_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    args = [*PLAN, "--sweep-file", str(_sweep(tmp_path / "sweep.json")), "--disagg", *extra]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_cpu_tier_layout_reports_tier_hits_with_the_real_simulator() -> None:
    """64 users' 4-turn chats (~16k-token prompts at the last turn) overflow one L40S's
    GPU prefix cache: with a 16 GiB CPU tier the later turns load their prefixes back."""
    setup = DisaggSetup("L40S", "llama-3.1-8b", 1, "bf16", SLO, duration_s=100.0)
    sessions = "sessions:users=64,turns=4,input=4000,output=20"
    rows = compare_layouts(setup, layouts_for(1, cpu_gibs=(16,)), sessions, 1.5, jobs=1)
    by_name = {r["name"]: r for r in rows}
    plain, tiered = by_name["colocated"], by_name["colocated+cpu16"]
    assert plain["kv_tiers"] is None and plain["kv_tier_hit_rate"] is None
    assert tiered["kv_tiers"]["cpu_hit_tokens"] > 0 and tiered["kv_tier_hit_rate"] > 0.02
    assert tiered["ttft_ms"]["p50"] < plain["ttft_ms"]["p50"]  # loads replace prefills
    assert plain["kv_transfer_ms"] is None and tiered["kv_transfer_ms"] is None
