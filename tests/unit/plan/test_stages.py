"""Growth stages (S4.7): which deployment each card count runs, and which must-dos and
indicators follow from its ledger and its simulated run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiloserve.catalog import get_gpu, get_model
from kiloserve.plan.capacity import CapacityResult
from kiloserve.plan.planner import Candidate, enumerate_candidates
from kiloserve.plan.stage_runs import stages_markdown, write_stages
from kiloserve.plan.stages import (
    STAGE_CARDS,
    StageChoice,
    build_stage,
    choose_for_stage,
    gateway_cores,
    must_dos,
)


def _qwen72b() -> list[Candidate]:
    return enumerate_candidates(get_model("qwen2-72b"), [get_gpu("H100")])


def _capacities(per_tp: dict[int, float]) -> dict[str, CapacityResult]:
    return {
        f"H100-SXM TP{tp} bf16": CapacityResult(r, r * 200, "test", True)
        for tp, r in per_tp.items()
    }


def _price(cand: Candidate) -> float:
    return 2.5


def _summary(
    *,
    utilisation: list[float],
    ttft_p50: float = 100.0,
    ttft_p99: float = 150.0,
    hit_rate: float | None = 0.0,
    e2e_mean_ms: float = 4000.0,
) -> dict[str, Any]:
    per_backend = {
        f"b{i}": {"utilisation_mean": u, "kv_usage_mean": 0.5, "kv_usage_max": 0.9}
        for i, u in enumerate(utilisation)
    }
    return {
        "ttft_ms": {"p50": ttft_p50, "p95": ttft_p99 * 0.9, "p99": ttft_p99},
        "tpot_ms": {"p50": 30.0, "p95": 40.0},
        "e2e_ms": {"p50": 3000.0, "p95": 9000.0, "mean": e2e_mean_ms},
        "per_backend": per_backend,
        "prefix_cache": {"hit_rate": hit_rate},
    }


def _texts(items: Any) -> str:
    return " | ".join(i.text for i in items)


def test_stage_cards_are_the_seeds_five() -> None:
    assert STAGE_CARDS == (1, 4, 32, 256, 1024)


def test_choice_follows_the_ledger_and_the_cost_per_request() -> None:
    cands = _qwen72b()  # 72B bf16: TP1 and TP2 do not fit an H100 (ledger)
    caps = _capacities({4: 2.5, 8: 5.4})
    assert choose_for_stage(1, cands, caps, _price, 1.25) is None
    four = choose_for_stage(4, cands, caps, _price, 1.25)
    assert four is not None and four.candidate.tp == 4 and four.num_replicas == 1
    assert four.rate_rps == pytest.approx(2.5 / 1.25)
    # 32 cards: 8 x TP4 sustain 16 req/s, 4 x TP8 17.28: TP8 is cheaper per request
    big = choose_for_stage(32, cands, caps, _price, 1.25)
    assert big is not None and big.candidate.tp == 8 and big.num_replicas == 4
    assert big.cost_per_request == pytest.approx(32 * 2.5 / (4 * 5.4 / 1.25 * 3600))
    # equal cost per request: the smaller TP wins
    tie = choose_for_stage(32, cands, _capacities({4: 2.5, 8: 5.0}), _price, 1.25)
    assert tie is not None and tie.candidate.tp == 4


def test_a_stage_where_nothing_fits_names_the_ledger_reason() -> None:
    cands = _qwen72b()
    stage = build_stage(1, 1, None, None, candidates=cands, previous=None,
                        mean_output_tokens=200, policy="default")  # fmt: skip
    (item,) = stage.must_dos
    assert "nothing in 1 card(s) fits and meets the SLO" in item.text and "int4" in item.text
    assert "H100-SXM TP1 bf16: Qwen2-72B bf16 needs 145 GB of weights" in item.reason
    assert stage.to_dict()["deployment"] is None


def _choice(num_cards: int, tp: int, rate_rps: float) -> StageChoice:
    cand = next(c for c in _qwen72b() if c.tp == tp)
    cap = CapacityResult(2.5, 500.0, "test", True)
    return StageChoice(cand, cap, num_cards // tp, rate_rps, num_cards * 2.5)


def test_one_replica_needs_no_gateway_and_states_its_tp_and_concurrency() -> None:
    choice = _choice(4, 4, 2.0)
    do, skip = must_dos(choice, _summary(utilisation=[0.8]), _qwen72b(), 200, "default")
    assert do[0].text == "run H100-SXM TP4 bf16, 1 replica(s)"
    assert "TP2 does not fit" in do[0].reason and "440,960 tokens" in do[0].reason
    # Little's law: 2 req/s x 4 s mean E2E = 8 in flight
    assert do[1].value == pytest.approx(8.0)
    assert "inside one node" in _texts(do)
    assert "gateway" not in _texts(do)
    assert "a gateway" in _texts(skip)


def test_mechanisms_kick_in_with_scale() -> None:
    cands = _qwen72b()
    small = _summary(utilisation=[0.5, 0.7])
    do, skip = must_dos(_choice(8, 4, 4.0), small, cands, 200, "least_request")
    assert "load-aware routing (least_request)" in _texts(do)
    assert "slow-node demotion" in _texts(skip)  # 2 replicas: no pool median
    assert "etcd registry" in _texts(skip)  # one node
    (spread,) = [d for d in do if "load-aware" in d.text]
    assert "10.0 pp" in spread.reason  # std of 50% and 70%

    utils = [0.6] * 8
    do, skip = must_dos(_choice(32, 4, 16.0), _summary(utilisation=utils), cands, 200, "default")
    assert "slow-node demotion on" in _texts(do)
    assert "etcd registry with a node agent" in _texts(do)
    assert "4 nodes of 8" in next(d.reason for d in do if "etcd" in d.text)
    assert "gateway workers" not in _texts(do)  # 16 req/s: 0.1 cores


def test_gateway_workers_prefix_routing_and_admission_come_from_the_run() -> None:
    # 516 req/s of 196-token streams: (275 + 196 x 29) us each = 3.08 cores
    assert gateway_cores(516.0, 196) == pytest.approx(516 * (275 + 196 * 29) / 1e6)
    summary = _summary(utilisation=[0.6] * 4, ttft_p50=100.0, ttft_p99=600.0, hit_rate=0.3)
    do, skip = must_dos(_choice(1024, 4, 516.0), summary, _qwen72b(), 196, "default")
    workers = next(d for d in do if "gateway workers" in d.text)
    assert workers.text.startswith("gateway workers: 7 in all")  # ceil(3.08 / 0.5)
    assert "prefix-aware routing" in _texts(do)
    admission = next(d for d in do if "admission" in d.text)
    assert "TTFT P99 / P50 = 6.0" in admission.reason
    quiet = _summary(utilisation=[0.6] * 4, hit_rate=None)
    do, skip = must_dos(_choice(32, 4, 16.0), quiet, _qwen72b(), 196, "default")
    assert "prefix-aware routing" in _texts(skip) and "admission control" in _texts(skip)


def test_indicators_and_the_files(tmp_path: Path) -> None:
    cands = _qwen72b()
    prev = _choice(32, 4, 16.0)
    choice = _choice(256, 4, 128.0)
    summary = _summary(utilisation=[0.5, 0.7])
    stage = build_stage(4, 256, choice, summary, candidates=cands, previous=prev,
                        mean_output_tokens=200, policy="default")  # fmt: skip
    names = _texts(stage.indicators)
    assert "KV-cache usage" in names and "utilisation std-dev" in names
    assert "$/request (Pareto analysis every +128 cards)" in names
    spread = next(i for i in stage.indicators if "std-dev" in i.text)
    assert spread.value == pytest.approx(10.0)
    assert stage.targets_ms["ttft_p50"] == 100.0 and stage.targets_ms["e2e_p95"] == 9000.0
    header = {"command": ["kiloserve", "plan"], "model": "Qwen2-72B", "workload": "w",
              "slo": "ttft_p95=800ms", "target_rps": 100.0, "headroom": 1.25, "duration_s": 60.0,
              "policy": "default", "seed": 0}  # fmt: skip
    text = write_stages(tmp_path, [stage], header)
    assert text == (tmp_path / "stages.md").read_text() == stages_markdown([stage], header)
    assert "## Stage 4: 256 card(s)" in text and "P95 < 150 ms" in text
    assert "The target, 100 req/s, is within stage 4." in text  # 128 req/s sustained
    data = json.loads((tmp_path / "stages.json").read_text())
    (row,) = data["stages"]
    assert row["num_cards"] == 256 and row["deployment"]["num_replicas"] == 64
    assert row["must_dos"][0]["reason"] and row["indicators"][0]["reason"]
