"""KV-cache events in the simulator: simulated engines feed the gateway's exact index
through the live gateway's feed code, and routing uses it (issue 14)."""

from __future__ import annotations

from typing import Any

from kiloserve.engine.sequence import Sequence
from kiloserve.kvevents.wire import BlockRemoved, BlockStored
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from kiloserve.sim import parse_fault, simulate
from kiloserve.sim.kvevents import SimKvEvents
from kiloserve.workload import load_workload

# 20 tenants, each a 2,000-token system prompt, short unique user turns
SPEC = "synthetic:input=uniform(64,128),output=uniform(20,40),prefix_groups=20,prefix_tokens=2000"


def _cluster(kv_events: bool) -> ClusterConfig:
    line: dict[str, Any] = {"name": "h100", "gpu": "H100", "model": "llama-3.1-8b", "count": 4}
    if kv_events:
        line["kv_events_endpoint"] = "auto"
    return parse_cluster_config({"backends": [line]})


def _run(kv_events: bool, **kw: Any) -> dict[str, Any]:
    workload = load_workload(SPEC, seed=3, rate=20, num_requests=300, with_prompts=False)
    return simulate(_cluster(kv_events), workload, "default", seed=3, **kw).summary


def test_engines_publish_into_the_gateways_exact_index() -> None:
    summary = _run(True)
    kv = summary["kv_events"]
    assert kv["publishers"] == 4 and kv["exact"] == 4
    assert kv["events"] > 0 and kv["index_blocks"] > 0
    # the engines' own counters: most prompt tokens are the tenants' shared heads
    assert summary["prefix_cache"]["hit_rate"] > 0.7
    assert set(summary["pools"]) == {"H100-SXM"}
    assert 0.0 < summary["pools"]["H100-SXM"]["busy_fraction"] <= 1.0


def test_without_kv_events_nothing_is_published() -> None:
    summary = _run(False)
    assert summary["kv_events"] == {
        "publishers": 0, "exact": 0, "batches": 0, "events": 0, "index_blocks": 0
    }  # fmt: skip
    assert summary["prefix_cache"]["hit_rate"] > 0.5  # the approximate index still works


def test_a_dead_engine_loses_its_entries_and_publishes_again_after_recovery() -> None:
    died = _run(True, faults=[parse_fault("t=3,backend=h100-0,kind=die")])
    assert died["kv_events"]["exact"] == 3  # h100-0's feed was lost and stays lost
    back = _run(
        True,
        faults=[
            parse_fault("t=3,backend=h100-0,kind=die"),
            parse_fault("t=5,backend=h100-0,kind=recover"),
        ],
    )
    assert back["kv_events"]["exact"] == 4  # the fresh engine numbers from 0 again


def test_pending_stores_become_events_in_order_when_delivered() -> None:
    events = SimKvEvents(block_size=4)
    sink = events.new_sink("e0")
    seq = Sequence("s", list(range(17)), 4, block_size=4)  # 4 full blocks
    hashes = seq.block_hashes
    sink.stored(seq, 0, 2)
    sink.removed([hashes[0]])
    sink.stored(seq, 2, 4)
    assert len(sink.events) == 3 and isinstance(sink.events[0], tuple)  # not made yet
    events.deliver()
    assert sink.events == [] and sink.next_seq == 1
    index = events.cache.index
    assert index.match_depths(hashes) == {}  # block 0 was removed
    assert index.match_depths(hashes[1:]) == {"e0": 3}
    feed = events.cache.feed("e0")
    assert feed.counters.events == 3 and feed.mode == "exact"
    sink.stored(seq, 0, 1)
    sink.removed([hashes[3]])
    assert sink.take_events() == (
        BlockStored((hashes[0],), None, (), 4), BlockRemoved((hashes[3],))
    )  # fmt: skip
    events.deliver()  # an empty batch: take_events emptied the queue
    sink.stored(seq, 1, 3)
    events.engine_lost("e0", sink)
    events.deliver()  # nothing left to deliver: the lost engine's events went with it
    assert feed.counters.batches == 2 and index.num_blocks == 0
