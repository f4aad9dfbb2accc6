"""Health verdicts shared by the workers of one gateway (``routing.shared_verdicts``).

Two ``Resilience`` objects, each with its own table and router (two workers), attached
as workers 0 and 1 to one real shared-memory segment. What one worker finds (failed
probes, an ejection, a demotion) holds on the other after its next tick; before the
sharing a backend worker 0 ejected stayed healthy on worker 1.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.gateway.resilience.manager import (
    EJECT_VETO,
    PEER_EJECT_VETO,
    PEER_PROBE_VETO,
    PROBE_VETO,
    Resilience,
)
from kiloserve.policies.base import Outcome, RequestInfo
from kiloserve.policies.least_request import LeastRequestPolicy
from kiloserve.routing.router import Router
from kiloserve.routing.shared_load import LoadLayout, SharedLoad
from kiloserve.routing.shared_verdicts import EJECT, PROBE, SharedVerdicts
from kiloserve.routing.table import BackendTable

_INFO = RequestInfo("r", model="m", input_tokens=10, predicted_output_tokens=4)
_FAILED = Outcome(ok=False, status=500)


def _resilience() -> Resilience:
    cfg = parse_gateway_config(
        {
            "backends": [
                {"url": "http://127.0.0.1:9", "name": "a", "models": ["m"]},
                {"url": "http://127.0.0.1:10", "name": "b", "models": ["m"]},
            ],
            "outlier": {"consecutive_gateway_failures": 2, "max_ejection_percent": 100},
            "demotion": {"max_ttft_ms": 1000.0, "min_num_samples": 2, "slow_start_s": 0},
        }
    )
    table = BackendTable(cfg)
    router = Router(table, LeastRequestPolicy(), random.Random(0))
    return Resilience(cfg, router, GatewayMetrics(table))


@contextlib.contextmanager
def _segment(num_workers: int, slots: int = 8, ring: int = 16) -> Iterator[list[SharedLoad]]:
    """A real segment and one attached handle per worker, closed at the end."""
    owner = SharedLoad.create(LoadLayout(workers=num_workers, slots=slots, ring=ring))
    loads = [SharedLoad.attach(owner.name, i) for i in range(num_workers)]
    try:
        yield loads
    finally:
        for load in loads:
            load.close()
        owner.close()


@pytest.fixture
def workers() -> Iterator[tuple[Resilience, Resilience]]:
    owner = SharedLoad.create(LoadLayout(workers=2, slots=8, ring=16))
    loads = [SharedLoad.attach(owner.name, i) for i in (0, 1)]
    pair = (_resilience(), _resilience())
    for r, load in zip(pair, loads, strict=True):
        r.share = SharedVerdicts(load)
        r.share.clear()
    yield pair
    for load in loads:
        load.close()
    owner.close()


def _eject(r: Resilience, backend_id: str) -> None:
    for _ in range(2):
        r.on_complete(backend_id, _INFO, _FAILED)
    assert EJECT_VETO in r.table.record(backend_id).vetoes


def test_a_backend_one_worker_ejects_is_held_out_by_the_other(
    workers: tuple[Resilience, Resilience],
) -> None:
    w0, w1 = workers
    _eject(w0, "a")
    assert w1.table.state("a").healthy  # not yet: at its next tick
    w1.tick(time.monotonic())
    assert not w1.table.state("a").healthy
    assert w1.table.record("a").vetoes == {PEER_EJECT_VETO}
    router = Router(w1.table, LeastRequestPolicy(), random.Random(0))
    assert router.decide(_INFO, time.monotonic()).ranked == ("b",)
    # its ejection over, worker 0's probe succeeds: it lets the backend back, and so
    # does worker 1
    w0.outlier.tick(time.monotonic() + 3600)
    w0._on_probe("a", True, "", time.monotonic())
    assert EJECT_VETO not in w0.table.record("a").vetoes
    w1.tick(time.monotonic())
    assert w1.table.state("a").healthy and not w1.table.record("a").vetoes


def test_failed_probes_on_one_worker_hold_on_the_other_and_panic_still_works(
    workers: tuple[Resilience, Resilience],
) -> None:
    w0, w1 = workers
    for b in ("a", "b"):
        for _ in range(w0.cfg.health.unhealthy_threshold):
            w0._on_probe(b, False, "connect", time.monotonic())
        assert PROBE_VETO in w0.table.record(b).vetoes
    w1.tick(time.monotonic())
    for b in ("a", "b"):
        assert w1.table.record(b).vetoes == {PEER_PROBE_VETO}
    # every backend failed probes somewhere: worker 1 trusts traffic over probes (panic)
    assert set(w1.admit((), frozenset({"a", "b"}))) == {"a", "b"}
    assert w1.num_panics == 1


def test_a_demotion_on_one_worker_lowers_the_weight_on_the_other(
    workers: tuple[Resilience, Resilience],
) -> None:
    w0, w1 = workers
    now = time.monotonic()
    for i in range(3):
        w0.on_first_token("a", _INFO, 5000.0)
        w0.on_first_token("b", _INFO, 50.0)
        w0.demoter.observe("a", now + i * 0.01, 5000.0, None)
    w0.tick(now + 1)
    low = w0.cfg.demotion.demoted_weight
    assert w0.table.state("a").effective_weight == pytest.approx(low)
    assert w1.table.state("a").effective_weight == 1.0
    w1.tick(now + 1)
    assert w1.table.state("a").effective_weight == pytest.approx(low)
    assert w1.table.state("b").effective_weight == 1.0
    assert w1.describe("a", now + 1)["sibling_weight_factor"] == pytest.approx(low)


def test_a_worker_that_ejected_runs_its_trial_whatever_the_others_hold(
    workers: tuple[Resilience, Resilience],
) -> None:
    """Both workers ejected the backend: each one's trial ignores the other's ejection
    (waiting on each other, the backend would never come back)."""
    w0, w1 = workers
    _eject(w0, "a")
    _eject(w1, "a")
    w0.tick(time.monotonic())
    assert w0.table.record("a").vetoes == {EJECT_VETO, PEER_EJECT_VETO}
    later = time.monotonic() + 3600  # past the ejection time: half-open
    w0.outlier.tick(later)
    assert w0.admit(("b",), frozenset({"a", "b"}))[0] == "a"


def test_a_replacement_worker_clears_its_predecessors_verdicts(
    workers: tuple[Resilience, Resilience],
) -> None:
    w0, w1 = workers
    assert w1.share is not None
    _eject(w1, "a")
    w0.tick(time.monotonic())
    assert not w0.table.state("a").healthy
    w1.share.clear()  # what a restarted worker 1 does before it serves
    w0.tick(time.monotonic())
    assert w0.table.state("a").healthy


def test_flags_and_factors_combine_over_the_other_workers() -> None:
    owner = SharedLoad.create(LoadLayout(workers=3, slots=4, ring=8))
    loads = [SharedLoad.attach(owner.name, i) for i in range(3)]
    try:
        v = [SharedVerdicts(load) for load in loads]
        v[1].publish("a", PROBE, 0.5)
        v[2].publish("a", EJECT, 0.8)
        v[0].publish("a", EJECT, 0.1)  # its own: not in its view of the others
        assert v[0].changed()
        assert v[0].peers(["a", "b"]) == {"a": (PROBE | EJECT, 0.5), "b": (0, 1.0)}
        assert not v[0].changed()
        assert v[1].peers(["a"]) == {"a": (EJECT, pytest.approx(0.1))}
    finally:
        for load in loads:
            load.close()
        owner.close()


def test_worker_0s_passing_probes_close_a_half_open_breaker_of_a_worker_that_skips_them(
    workers: tuple[Resilience, Resilience],
) -> None:
    """Worker 1 ejected the backend and leaves its probes to worker 0: when the ejection
    is over and worker 0's probes pass, worker 1's breaker closes at its probe turn, as
    on a passing probe of its own. Before, it stayed half-open until a request reached
    worker 1, and every worker held the backend out meanwhile (with no traffic, for
    good: the chaos drills' "cluster did not settle")."""
    w0, w1 = workers
    w1.probed_elsewhere = lambda _b: True
    _eject(w1, "a")
    w0.tick(time.monotonic())
    assert not w0.table.state("a").healthy  # held out by worker 0 too
    assert w1._probed_elsewhere("a")  # its ejection not over yet: stays
    assert EJECT_VETO in w1.table.record("a").vetoes
    w1.outlier.tick(time.monotonic() + 3600)  # half-open
    for _ in range(w0.cfg.health.unhealthy_threshold):  # worker 0's probes fail now
        w0._on_probe("a", False, "connect", time.monotonic())
    w1.tick(time.monotonic())
    assert w1._probed_elsewhere("a")
    assert EJECT_VETO in w1.table.record("a").vetoes  # a failing probe closes nothing
    for _ in range(w0.cfg.health.healthy_threshold):  # they pass again
        w0._on_probe("a", True, "", time.monotonic())
    w1.tick(time.monotonic())
    assert w1._probed_elsewhere("a")
    assert EJECT_VETO not in w1.table.record("a").vetoes
    w0.tick(time.monotonic())
    assert w0.table.state("a").healthy and w1.table.state("a").healthy


def test_failures_spread_over_the_workers_are_one_run(
    workers: tuple[Resilience, Resilience],
) -> None:
    """Envoy counts a host's consecutive failures over all its worker threads. Before,
    each worker counted its own run: one failure on each of two workers (threshold 2)
    ejected nothing, and in a fresh-clone CI run four stalls, two on each worker, did
    not eject the stalled backend."""
    w0, w1 = workers
    w0.on_complete("a", _INFO, _FAILED)
    assert not w0.outlier.is_ejected("a")
    w1.on_complete("a", _INFO, _FAILED)
    assert w1.outlier.is_ejected("a")
    assert w1.outlier.describe("a", time.monotonic())["last_ejection_reason"] == (
        "2 consecutive failures (last 500)"
    )
    w0.tick(time.monotonic())
    assert w0.table.record("a").vetoes == {PEER_EJECT_VETO}


def test_a_success_on_one_worker_ends_the_run_on_every_worker(
    workers: tuple[Resilience, Resilience],
) -> None:
    w0, w1 = workers
    w0.on_complete("a", _INFO, _FAILED)
    w1.on_complete("a", _INFO, Outcome(ok=True, status=200))
    w0.on_complete("a", _INFO, _FAILED)  # a run of one: the success came between
    assert not w0.outlier.is_ejected("a") and not w1.outlier.is_ejected("a")
    w1.on_complete("a", _INFO, _FAILED)
    assert w1.outlier.is_ejected("a")


def test_an_ejection_ends_the_run_it_ejected_for(
    workers: tuple[Resilience, Resilience],
) -> None:
    """Worker 0's failure before worker 1's ejection is not counted again: after the
    ejection, worker 0 needs a run of its own (here with the siblings') from zero."""
    w0, w1 = workers
    w0.on_complete("a", _INFO, _FAILED)
    w1.on_complete("a", _INFO, _FAILED)
    assert w1.outlier.is_ejected("a")
    w0.on_complete("a", _INFO, _FAILED)  # a request in flight when it was ejected
    assert not w0.outlier.is_ejected("a")
    w0.on_complete("a", _INFO, _FAILED)
    assert w0.outlier.is_ejected("a")


def test_a_long_run_on_one_worker_is_counted_exactly() -> None:
    """More failures than a sibling's ring holds (``STREAK_RING``): a worker's own run
    still counts each, so a threshold above the ring still ejects."""
    from kiloserve.routing.shared_load import STREAK_RING

    with _segment(2, slots=4, ring=8) as loads:
        v0, v1 = (SharedVerdicts(load) for load in loads)
        n = STREAK_RING + 5
        assert [v0.note_failure("a", float(t), t) for t in range(1, n + 1)][-1] == n
        # worker 1 sees worker 0's last STREAK_RING failures and its own one
        assert v1.note_failure("a", n + 1.0, 1) == STREAK_RING + 1
        v1.note_reset("a", n + 2.0)
        assert v0.note_failure("a", n + 3.0, n + 1) == 1  # worker 1's success came between


def test_max_ejection_percent_counts_the_siblings_ejections() -> None:
    """Two backends, at most 50% ejected: worker 0 ejected "a", so worker 1's failures on
    "b" must not eject "b" too (before, each worker held its own 50%, and the two
    together ejected the whole pool)."""
    with _segment(2) as loads:
        pair = (_resilience(), _resilience())
        for r, load in zip(pair, loads, strict=True):
            r.outlier.cfg = r.outlier.cfg.model_copy(update={"max_ejection_percent": 50.0})
            r.share = SharedVerdicts(load)
            r.share.clear()
        w0, w1 = pair
        _eject(w0, "a")
        w1.tick(time.monotonic())
        for _ in range(4):
            w1.on_complete("b", _INFO, _FAILED)
        assert not w1.outlier.is_ejected("b")
        assert w1.table.state("b").healthy


def _routed_pair(
    loads: list[SharedLoad],
) -> tuple[tuple[Resilience, Router], tuple[Resilience, Router]]:
    """Two workers whose tables share the load segment (samples included), wired as
    ``gateway/workers.py`` wires them."""
    pair = []
    for load in loads:
        r = _resilience()
        router = Router(r.table, LeastRequestPolicy(), random.Random(0))
        router.first_token_listeners.append(r.on_first_token)
        r.table.shared = load
        load.on_sample = r.on_sibling_sample
        r.share = SharedVerdicts(load)
        r.share.clear()
        pair.append((r, router))
    return pair[0], pair[1]


def test_the_demoter_judges_every_workers_samples() -> None:
    """Slow first tokens on "a" (5,000 ms over a 1,000 ms bound, two samples needed),
    one met by each worker: each worker's demoter has both and demotes it. Before, each
    judged only its own share (one sample each: nothing), so with N workers a slow node
    took N times the samples to be demoted."""
    with _segment(2) as loads:
        (w0, r0), (w1, r1) = _routed_pair(loads)
        r0.first_token("a", _INFO, 5000.0)
        r1.first_token("a", _INFO, 5000.0)
        now = time.monotonic()
        w0.tick(now)
        w1.tick(now)
        low = w0.cfg.demotion.demoted_weight
        for w in (w0, w1):
            assert w.demoter.weight_factor("a", now) == pytest.approx(low)
            assert w.demoter.weight_factor("b", now) == 1.0


def test_a_probe_failure_from_when_a_worker_probed_for_itself_ends_with_worker_0s_passes(
    workers: tuple[Resilience, Resilience],
) -> None:
    """Worker 1 probed for itself while worker 0's scrape was stale and found "a"
    failing; then worker 0 probes again (its probes of "a" pass) and worker 1 skips its
    own. Before, worker 1's verdict was never probed again and held "a" out of both
    workers for good (a fresh-clone CI run of the real failover test)."""
    w0, w1 = workers
    for _ in range(w1.cfg.health.unhealthy_threshold):
        w1._on_probe("a", False, "timeout", time.monotonic())
    assert PROBE_VETO in w1.table.record("a").vetoes
    w0.tick(time.monotonic())
    assert w0.table.record("a").vetoes == {PEER_PROBE_VETO}
    w1.probed_elsewhere = lambda _b: True  # worker 0 is back: it probes for worker 1
    w1.tick(time.monotonic())
    assert w1._probed_elsewhere("a")
    assert not w1.table.record("a").vetoes and w1.table.state("a").healthy
    w0.tick(time.monotonic())
    assert w0.table.state("a").healthy and not w0.table.record("a").vetoes
