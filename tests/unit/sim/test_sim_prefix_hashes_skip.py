"""``Policy.reads_prefix_hashes``: the simulator hashes prompts only for a policy that
reads the hashes, and skipping them changes nothing for one that does not."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kiloserve.launch.config import load_cluster_config
from kiloserve.policies import create_policy
from kiloserve.policies.base import ClusterSnapshot, Decision, Outcome, RequestInfo
from kiloserve.policies.protocol import Policy
from kiloserve.sim import simulate
from kiloserve.workload import load_workload

ROOT = Path(__file__).resolve().parents[3]
WALL_CLOCK = ("sim_wall_s", "sim_cpu_s", "real_time_factor", "requests_per_wall_s", "duration_s")


class Recording:
    """Wraps a policy without saying ``reads_prefix_hashes`` (so hashes are built) and
    records the prefix hashes each request came with."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name = inner, inner.name
        self.seen: list[tuple[int, ...]] = []

    def choose(
        self, request: RequestInfo, snapshot: ClusterSnapshot, rng: random.Random
    ) -> Decision:
        self.seen.append(request.prefix_hashes)
        return self.inner.choose(request, snapshot, rng)

    def on_dispatch(self, request: RequestInfo, backend_id: str) -> None:
        self.inner.on_dispatch(request, backend_id)

    def on_complete(self, request: RequestInfo, backend_id: str, outcome: Outcome) -> None:
        self.inner.on_complete(request, backend_id, outcome)


def _summary(policy: Policy) -> dict[str, Any]:
    cluster = load_cluster_config(ROOT / "examples" / "cluster.yaml")
    spec = "synthetic:input=uniform(200,900),output=uniform(8,40),prefix_groups=5,prefix_tokens=300"
    workload = load_workload(spec, rate=6.0, num_requests=150, with_prompts=False)
    summary = simulate(cluster, workload, policy).summary
    return {k: v for k, v in summary.items() if k not in WALL_CLOCK}


@pytest.mark.parametrize(
    ("name", "params", "reads"),
    [
        ("round_robin", {}, False),
        ("least_request", {}, False),
        ("least_tokens", {}, False),
        ("power_of_two", {}, False),
        ("default", {}, True),
        ("prefix_affinity", {}, True),
        ("scored", {"scorers": {"queue": 1.0, "kv": 1.0}}, False),
        ("scored", {"scorers": {"queue": 1.0, "prefix": 1.0}}, True),
    ],
)
def test_which_policies_read_prefix_hashes(name: str, params: dict[str, Any], reads: bool) -> None:
    assert getattr(create_policy(name, params), "reads_prefix_hashes", True) is reads


def test_skipping_the_hashes_changes_no_result() -> None:
    skipping = Recording(create_policy("round_robin"))
    skipping.reads_prefix_hashes = False  # type: ignore[attr-defined]
    hashing = Recording(create_policy("round_robin"))
    assert _summary(skipping) == _summary(hashing)
    assert not any(skipping.seen)  # no request was hashed for it...
    assert sum(map(bool, hashing.seen)) > 100  # ...and nearly all were without the flag
