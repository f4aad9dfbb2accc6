"""Scheduled faults: parsing, and what dying, slowing and recovering do to routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiloserve.errors import ConfigError
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.sim import FaultEvent, SimResult, load_faults, parse_fault, simulate
from kiloserve.workload import load_workload

SPEC = "synthetic:input=uniform(64,256),output=uniform(100,200)"


def _cluster() -> ClusterConfig:
    return parse_cluster_config(
        {"backends": [{"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 2}]}
    )


def _run(faults: list[FaultEvent], policy: str = "round_robin") -> SimResult:
    workload = load_workload(SPEC, seed=1, rate=20, num_requests=200, with_prompts=False)
    return simulate(_cluster(), workload, policy, faults=faults, keep_records=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("t=30,backend=h100-0,kind=die", FaultEvent(30.0, "h100-0", "die")),
        (" t=1.5 , backend=a , kind=slow , factor=3 ", FaultEvent(1.5, "a", "slow", 3.0)),
        ("kind=recover,backend=b,t=0", FaultEvent(0.0, "b", "recover")),
    ],
)
def test_parse_fault(text: str, expected: FaultEvent) -> None:
    assert parse_fault(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("t=1,backend=a,kind=explode", "unknown fault kind"),
        ("t=1,backend=a", "needs t=, backend= and kind="),
        ("t=-1,backend=a,kind=die", ">= 0"),
        ("t=1,backend=a,kind=slow,factor=0", "factor must be > 0"),
        ("t=1,backend=a,kind=die,when=now", "bad fault part"),
        ("t=soon,backend=a,kind=die", "must be numbers"),
    ],
)
def test_parse_fault_rejects(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fault(text)


def test_load_faults_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "faults.yaml"
    path.write_text(
        "faults:\n  - {t: 5, backend: h100-1, kind: slow, factor: 2}\n"
        "  - t=1,backend=h100-0,kind=die\n"
    )
    assert load_faults(path) == [
        FaultEvent(1.0, "h100-0", "die"),
        FaultEvent(5.0, "h100-1", "slow", 2.0),
    ]


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        _run([parse_fault("t=1,backend=nope,kind=die")])


def test_die_fails_over_and_cuts_started_streams() -> None:
    result = _run([parse_fault("t=3,backend=h100-0,kind=die")])
    failed = [r for r in result.records if not r.is_ok]
    assert failed, "streams running on h100-0 at t=3 must be cut"
    assert all(r.backend == "h100-0" and "stream cut" in (r.error or "") for r in failed)
    assert all(r.start_s < 3.0 for r in failed)
    # requests that reached the dead backend before a byte was sent were retried
    retried = [rid for rid, _ in result.routing if rid in _dupes(result.routing)]
    assert retried
    # once three scrapes failed (0.6 s) the gateway stops choosing the dead backend
    late = {r.backend for r in result.records if r.start_s > 3.7}
    assert late == {"h100-1"}
    assert result.summary["requests_ok"] + result.summary["requests_failed"] == 200


def _dupes(routing: list[tuple[str, str]]) -> set[str]:
    seen: set[str] = set()
    dupes: set[str] = set()
    for rid, _ in routing:
        (dupes if rid in seen else seen).add(rid)
    return dupes


def test_recover_brings_the_backend_back() -> None:
    result = _run(
        [parse_fault("t=2,backend=h100-0,kind=die"), parse_fault("t=4,backend=h100-0,kind=recover")]
    )
    after = {r.backend for r in result.records if r.start_s > 4.5}
    assert after == {"h100-0", "h100-1"}


def test_slow_backend_gets_slower_and_least_request_shifts_load() -> None:
    base = _run([])
    slow = _run([parse_fault("t=0,backend=h100-0,kind=slow,factor=4")])
    tpot = slow.summary["per_backend"]["h100-0"]["tpot_ms"]["p50"]  # type: ignore[index]
    base_tpot = base.summary["per_backend"]["h100-0"]["tpot_ms"]["p50"]  # type: ignore[index]
    assert tpot > 3.0 * base_tpot
    shifted = _run([parse_fault("t=0,backend=h100-0,kind=slow,factor=4")], "least_request")
    counts = {b: block["count"] for b, block in shifted.summary["per_backend"].items()}  # type: ignore[union-attr]
    assert counts["h100-1"] > counts["h100-0"]


def test_yaml_slowdown_fault_of_the_cluster_applies_from_the_start() -> None:
    slowed = parse_cluster_config(
        {
            "backends": [
                {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 2},
                {"name": "slow", "gpu": "H100", "model": "llama-3.1-8b",
                 "faults": {"slowdown": 3.0}},
            ]
        }
    )  # fmt: skip
    workload = load_workload(SPEC, seed=1, rate=20, num_requests=90, with_prompts=False)
    per_backend = simulate(slowed, workload, "round_robin").summary["per_backend"]
    slow_tpot = per_backend["slow"]["tpot_ms"]["p50"]  # type: ignore[index]
    fast_tpot = per_backend["h100-0"]["tpot_ms"]["p50"]  # type: ignore[index]
    assert slow_tpot > 2.5 * fast_tpot


def test_some_of_keeps_error_messages_short() -> None:
    from kiloserve.errors import some_of

    assert some_of(["a", "b"]) == "a, b"
    names = [f"b{i}" for i in range(368)]
    assert some_of(names) == "b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, ... (368 in all)"
    assert some_of(names[:10]) == ", ".join(names[:10])
