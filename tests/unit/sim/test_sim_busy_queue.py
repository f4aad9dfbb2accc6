"""Busy time while a fused run is in progress, and each request's engine queue time."""

from __future__ import annotations

from pathlib import Path

from kiloserve.launch.config import load_cluster_config
from kiloserve.sim import simulate
from kiloserve.workload import load_workload

TINY = Path(__file__).resolve().parents[3] / "examples" / "cluster-tiny.yaml"


def test_utilisation_counts_a_long_decode_while_it_runs() -> None:
    """One request decoding 3,000 tokens (~23 s, fused runs of many steps): every sample
    while it runs reads its backend busy. The series used to add a step's time only when
    it ended, so a backend decoding for 20 s read 0 until the very end."""
    workload = load_workload("synthetic:input=100,output=3000", rate=1, num_requests=1)
    result = simulate(load_cluster_config(TINY), workload, "round_robin", keep_records=True)
    (record,) = result.records
    assert record.e2e_s is not None and record.e2e_s > 20.0
    series = result.timeseries
    column = series["utilisation"][record.backend or ""]
    during = [u for t, u in zip(series["t_s"], column, strict=False) if 2.0 <= t <= 18.0]
    assert len(during) >= 5
    assert min(during) > 0.95
    idle = [c for b, c in series["utilisation"].items() if b != record.backend]
    assert all(u == 0.0 for column in idle for u in column)


def test_records_carry_the_engine_queue_time() -> None:
    """40 requests of 3,000 tokens at once on two engines: the first ones start at
    once (queue 0), later ones wait for the token budget; queue time <= TTFT."""
    workload = load_workload("synthetic:input=3000,output=20", rate=2000, num_requests=40)
    result = simulate(load_cluster_config(TINY), workload, "round_robin", keep_records=True)
    queues = sorted(r.queue_s for r in result.records if r.queue_s is not None)
    assert len(queues) == 40
    assert queues[0] == 0.0 and queues[-1] > 1.0
    for record in result.records:
        assert record.queue_s is not None and record.ttft_s is not None
        assert record.queue_s <= record.ttft_s
