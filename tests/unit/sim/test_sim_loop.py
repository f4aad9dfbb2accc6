"""Event loop ordering and determinism of the simulator."""

from __future__ import annotations

import gc
import heapq
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kiloserve.launch.config import ClusterConfig, load_cluster_config
from kiloserve.sim import simulate
from kiloserve.sim.events import Event
from kiloserve.sim.simulator import Simulator
from kiloserve.workload import load_workload

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "cluster-tiny.yaml"
WALL_KEYS = ("sim_wall_s", "sim_cpu_s", "real_time_factor", "requests_per_wall_s", "versions")
WORKLOAD = "synthetic:input=uniform(64,600),output=uniform(8,80),prefix_groups=4,prefix_tokens=256"


def _cluster() -> ClusterConfig:
    return load_cluster_config(TINY)


def _run(policy: str, seed: int = 0) -> tuple[dict[str, object], list[tuple[str, str]]]:
    workload = load_workload(WORKLOAD, seed=seed, rate=40, num_requests=150, with_prompts=False)
    result = simulate(_cluster(), workload, policy, seed=seed, keep_records=True)
    summary = {k: v for k, v in result.summary.items() if k not in WALL_KEYS}
    return summary, result.routing


def _bare_simulator(network_delay_s: float = 0.0) -> Simulator:
    from kiloserve.policies.registry import create_policy
    from kiloserve.sim.cluster import build_backends, build_gateway_config, describe_backends
    from kiloserve.sim.gateway import ModelPicker, SimGateway
    from kiloserve.sim.prompts import PromptIds
    from kiloserve.sim.results import MetricsCollector

    cfg = _cluster()
    backends = build_backends(cfg)
    gateway_cfg = build_gateway_config(cfg, describe_backends(cfg), 0.2)
    gateway = SimGateway(gateway_cfg, create_policy("round_robin"), backends, seed=0)
    empty = load_workload("synthetic:input=8,output=2", rate=1, num_requests=1)
    return Simulator(
        backends, gateway, iter(()), PromptIds(empty),
        MetricsCollector([b.backend_id for b in backends]),
        models=ModelPicker({"Llama-3.1-8B": 2.0}, None, 0),
        network_delay_s=network_delay_s, scrape_interval_s=0.2,
    )  # fmt: skip


@pytest.mark.parametrize("delay_s", [0.0, 0.5])
def test_event_queue_pops_in_time_order_and_ties_in_scheduling_order(delay_s: float) -> None:
    """The loop's queue, as ``run()`` drives it: pop the earliest, push its follow-ups.
    Events due one network delay after ``now`` wait in a FIFO beside the heap; the
    order must be the one a single heap gives. Plain ``Event`` instances (no subclass:
    the compiled build forbids interpreted subclasses of its classes), named by id."""
    sim = _bare_simulator(delay_s)
    names: dict[int, str] = {}

    def push(name: str, time_s: float) -> None:
        event = Event(time_s)
        names[id(event)] = name
        sim.push(event)

    for name, time_s in (("late", 2.0), ("tie-first", 1.0), ("tie-second", 1.0), ("early", 0.5)):
        push(name, time_s)
    # "early" (at 0.5) pushes children at now + delay, some tying with heap events
    follow = {
        "early": (("d1", 0.5 + delay_s), ("d2", 0.5 + delay_s), ("e1", 1.0)),
        "tie-first": (("child", 1.5), ("tie-child", 2.0), ("d3", 1.0 + delay_s)),
    }
    log: list[tuple[float, str]] = []
    while (event := sim.pop()) is not None:
        assert sim.now_s == event.time_s
        log.append((event.time_s, names[id(event)]))
        for name, child_s in follow.get(names[id(event)], ()):
            push(name, child_s)
    # what one heap ordered by (time, push serial) gives
    assert [name for _, name in log] == {
        0.0: ["early", "d1", "d2", "tie-first", "tie-second", "e1", "d3", "child", "late",
              "tie-child"],
        0.5: ["early", "tie-first", "tie-second", "d1", "d2", "e1", "child", "d3", "late",
              "tie-child"],
    }[delay_s]  # fmt: skip
    assert [t for t, _ in log] == sorted(t for t, _ in log)
    assert sim.num_queued == 0 and sim._times == [] and sim._first == sim._more == {}


@pytest.mark.parametrize("seed", range(6))
def test_event_queue_matches_one_heap_on_random_schedules(seed: int) -> None:
    """Random schedules against the reference, one heap ordered by (time, push serial):
    times on a coarse grid (many ties), children at ``now + delay`` (the FIFO) and at
    times already queued, so some reach the heap after a FIFO event of the same time."""
    delay_s = 0.25
    sim = _bare_simulator(delay_s)
    rng = random.Random(seed)
    serial = 0
    reference: list[tuple[float, int]] = []
    name_of: dict[int, int] = {}  # id(event) -> its push serial

    def push(time_s: float) -> None:
        nonlocal serial
        serial += 1
        event = Event(time_s)
        name_of[id(event)] = serial
        sim.push(event)
        heapq.heappush(reference, (time_s, serial))

    for _ in range(30):
        push(rng.randrange(0, 32) * 0.0625)  # a binary grid: sums stay exact
    popped: list[int] = []
    while (event := sim.pop()) is not None:
        expected = heapq.heappop(reference)
        popped.append(name_of[id(event)])
        assert (sim.now_s, popped[-1]) == expected
        if len(popped) < 400:
            for _ in range(rng.randrange(0, 3)):
                later = [t for t, _ in reference if t > sim.now_s]
                if later and rng.random() < 0.4:  # a time already queued (maybe in the FIFO)
                    push(rng.choice(later))
                else:
                    push(sim.now_s + rng.choice((delay_s, delay_s, 0.0625, 0.125, 0.5)))
    assert reference == [] and sim.num_queued == 0


@pytest.mark.parametrize("policy", ["round_robin", "random", "default", "power_of_two"])
def test_same_seed_same_result_within_one_process(policy: str) -> None:
    first, second = _run(policy), _run(policy)
    assert first[1] == second[1]
    assert json.dumps(first[0], sort_keys=True) == json.dumps(second[0], sort_keys=True)
    assert first[0]["requests_ok"] == 150


def test_kept_records_do_not_change_the_summary() -> None:
    workload = load_workload(WORKLOAD, rate=40, num_requests=150, with_prompts=False)
    summaries = [
        simulate(_cluster(), workload, "round_robin", keep_records=keep).summary
        for keep in (False, True)
    ]
    lean, kept = ({k: v for k, v in x.items() if k not in WALL_KEYS} for x in summaries)
    assert json.dumps(lean, sort_keys=True) == json.dumps(kept, sort_keys=True)


def test_a_run_restores_the_garbage_collector_settings() -> None:
    thresholds = gc.get_threshold()
    _run("round_robin")
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0


def test_the_loop_churn_triggers_no_young_collection() -> None:
    """Mooncake prompts (~15 k ids each) come and go: with the loop's threshold the
    collector stays idle (at 100 k it walked every young prompt list every ~20
    requests)."""
    from kiloserve.sim.simulator import GC_YOUNG_THRESHOLD

    workload = load_workload("mooncake", rate=20, num_requests=400, with_prompts=False)
    in_loop: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and gc.get_threshold()[0] == GC_YOUNG_THRESHOLD:
            in_loop.append(info["generation"])

    thresholds: list[int] = []  # the threshold in effect inside the loop
    gc.callbacks.append(count)
    try:
        summary = simulate(
            _cluster(), workload, "round_robin",
            progress=lambda _: thresholds.append(gc.get_threshold()[0]),
        ).summary  # fmt: skip
    finally:
        gc.callbacks.remove(count)
    assert summary["requests_ok"] == 400
    assert thresholds and set(thresholds) == {GC_YOUNG_THRESHOLD} and thresholds[0] >= 10**6
    assert in_loop == []


def test_another_seed_gives_another_random_routing() -> None:
    assert _run("random", seed=0)[1] != _run("random", seed=1)[1]


_CHILD = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
from test_sim_loop import _run
summary, routing = _run("default")
print(hashlib.sha256(json.dumps([summary, routing], sort_keys=True).encode()).hexdigest())
"""


def test_same_result_across_processes_with_different_hash_seeds() -> None:
    code = _CHILD.format(tests=str(Path(__file__).parent))
    digests = []
    for hash_seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
            timeout=60,
        )  # fmt: skip
        digests.append(out.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1]
