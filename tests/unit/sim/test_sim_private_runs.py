"""A Mooncake row's hash ids that no other row lists are text of its own: the simulated
engine keeps their blocks private (out of its prefix index, freed as one LRU segment),
which changes no request's outcome or route, only what the KV-event index holds."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_sim_run_hashes import MooncakeIds

from kiloserve.sim.prompts import PromptIds
from kiloserve.sim.sequence import SimSequence
from kiloserve.workload import RequestSpec, load_workload, read_trace
from kiloserve.workload.traces import PACKAGED_TRACES_DIR

TRACES = PACKAGED_TRACES_DIR
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="shipped traces not present")


def test_private_from_is_the_first_run_no_other_row_lists() -> None:
    rows = read_trace("mooncake", TRACES)
    num_rows = Counter(h for r in rows for h in set(r.hash_ids))
    workload = load_workload("mooncake:repeat=2", num_requests=2 * len(rows), with_prompts=False,
                             traces_dir=TRACES)  # fmt: skip
    prompts = PromptIds(workload, TRACES)
    num_private = 0
    for spec in workload:
        index = int(spec.request_id.rsplit("-", 1)[1])
        prompt = prompts.prompt(spec)
        ids = rows[index].hash_ids[: len(prompt.run_keys)]
        own = [i for i, h in enumerate(ids) if num_rows[h] == 1]
        expected = own[0] * 512 if own else None
        assert prompt.private_from == expected, spec.request_id
        num_private += expected is not None
    assert num_private > len(rows) // 4  # a good share of the trace's rows (both passes)


def test_private_runs_start_where_the_row_is_its_own_and_tiers_keep_them_shared() -> None:
    keys = (11, 22, 33)
    ids = [t for k in keys for t in range(k * 10_000, k * 10_000 + 512)] + [7] * 100
    seq = SimSequence("a", ids, 4, unique_key=1 << 40, unique_from=1536, run_keys=keys,
                      run_tokens=1536, private_from=512)  # fmt: skip
    assert seq.private_from_block == 32  # the second run on, not only the unique tail
    assert seq.block_hashes[:96] == SimSequence("b", ids, 4, run_keys=keys,
                                                run_tokens=1536).block_hashes[:96]  # fmt: skip
    seq.keep_runs_shared()  # an engine with KV tiers (sim/backend.py)
    assert seq.private_from_block == 96  # the unique tail only
    plain = SimSequence("c", ids[:1536], 4, run_keys=keys, run_tokens=1536, private_from=1024)
    assert plain.private_from_block == 64
    plain.keep_runs_shared()
    assert plain.private_from_block is None


@pytest.mark.parametrize(("config", "num_requests", "rate"), [
    ("cluster.yaml", 300, 8.0), ("cluster-pd.yaml", 200, 2.0),
])  # fmt: skip
def test_a_mooncake_run_is_the_same_with_and_without_private_runs(
    monkeypatch: pytest.MonkeyPatch, config: str, num_requests: int, rate: float
) -> None:
    """End to end: every request's outcome, route and latency, and the summary, are the
    same either way (cluster-pd.yaml's prefill twins have KV tiers); only the KV-event
    index holds fewer blocks (nobody could hit the private ones)."""
    from kiloserve.launch.config import load_cluster_config
    from kiloserve.sim import simulate
    from kiloserve.sim.sweep import without_wall_clock

    cluster = load_cluster_config(ROOT / "examples" / config)

    def run() -> tuple[dict[str, Any], list[Any]]:
        workload = load_workload("mooncake", rate=rate, num_requests=num_requests,
                                 with_prompts=False, traces_dir=TRACES)  # fmt: skip
        result = simulate(cluster, workload, "default", traces_dir=TRACES, keep_records=True)
        summary = without_wall_clock(result.summary)
        return summary, [r.to_dict() for r in result.records]

    private_summary, private_records = run()
    mooncake_ids = PromptIds._mooncake_ids

    def all_shared(self: PromptIds, spec: RequestSpec, n: int) -> MooncakeIds:
        ids, keys, _, num_run_ids = mooncake_ids(self, spec, n)
        return ids, keys, None, num_run_ids

    monkeypatch.setattr(PromptIds, "_mooncake_ids", all_shared)
    shared_summary, shared_records = run()
    assert private_records == shared_records
    events_private = private_summary.pop("kv_events")
    events_shared = shared_summary.pop("kv_events")
    assert private_summary == shared_summary
    assert shared_summary["prefix_cache"]["hits_tokens"] > 0
    if events_shared["publishers"]:  # cluster.yaml's twins publish KV events
        assert events_private["index_blocks"] < events_shared["index_blocks"]
