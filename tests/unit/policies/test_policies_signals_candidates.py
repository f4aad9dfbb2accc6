"""signals.candidates inlines base.eligible's routability rule: both must agree."""

from __future__ import annotations

import random

from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo
from kiloserve.policies.base import eligible
from kiloserve.policies.signals import candidates


def _random_backend(rng: random.Random, index: int) -> BackendState:
    return BackendState(
        backend_id=f"b{index}",
        models=frozenset(rng.sample(["m", "n"], rng.randint(1, 2))),
        healthy=rng.random() < 0.8,
        draining=rng.random() < 0.2,
        effective_weight=rng.choice([0.0, 0.2, 1.0, -1.0]),
        weight=rng.choice([0.0, 0.5, 1.0, -0.5]),
    )


def test_candidates_equal_eligible_minus_non_positive_weights() -> None:
    rng = random.Random(7)
    num_nonempty = 0
    for _ in range(300):
        backends = tuple(_random_backend(rng, i) for i in range(rng.randint(0, 12)))
        for model in ("m", "n", "x"):
            request = RequestInfo("r", model, 10, 10)
            expected = [
                b for b in eligible(request, ClusterSnapshot(0.0, backends)) if b.weight > 0.0
            ]
            got = candidates(request, ClusterSnapshot(0.0, backends))
            assert [b.backend_id for b in got] == [b.backend_id for b in expected]
            num_nonempty += bool(got)
    assert num_nonempty > 100  # the random states exercise non-trivial pools


def test_candidates_keep_snapshot_order_and_drop_unroutable() -> None:
    backends = (
        BackendState("a", models=frozenset({"m"})),
        BackendState("b", models=frozenset({"m"}), healthy=False),
        BackendState("c", models=frozenset({"m"}), draining=True),
        BackendState("d", models=frozenset({"m"}), effective_weight=0.0),
        BackendState("e", models=frozenset({"m"}), weight=0.0),
        BackendState("f", models=frozenset({"m"})),
    )
    got = candidates(RequestInfo("r", "m", 1, 1), ClusterSnapshot(0.0, backends))
    assert [b.backend_id for b in got] == ["a", "f"]
