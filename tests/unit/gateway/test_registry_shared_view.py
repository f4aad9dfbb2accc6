"""The registry view in the workers' segment (gateway/registry/watch.py): what one worker
applied from etcd is where a worker that starts later begins (etcd may be down then)."""

from __future__ import annotations

from segment_fixture import two_worker_segment  # noqa: F401 (the fixture ``segment``)

from kiloserve.gateway.config import BackendConfig, parse_gateway_config
from kiloserve.gateway.registry.record import RegistryRecord, encode_record
from kiloserve.gateway.registry.watch import RegistryWatcher
from kiloserve.routing.shared_load import SharedLoad
from kiloserve.routing.table import BackendTable

PREFIX = "/kiloserve/backends/"


def _record(name: str, draining: bool = False, score: float = 1.0) -> bytes:
    backend = BackendConfig(url=f"http://10.0.0.1:{8000 + int(name[1:])}", name=name, models=["m"])
    health = {"score": score, "nvml": {"temperature_c": 60 + score}}
    return encode_record(RegistryRecord(backend, is_draining=draining, health=health))


def _watcher(shared: SharedLoad | None) -> RegistryWatcher:
    cfg = parse_gateway_config({"backends": [], "registry": {"kind": "etcd", "etcd": ["x:1"]}})
    return RegistryWatcher(cfg, BackendTable(cfg), shared)


def test_a_later_worker_starts_from_what_its_sibling_applied(
    segment: list[SharedLoad],
) -> None:
    first = _watcher(segment[0])
    assert first.seed_from_siblings() == 0  # nobody has read etcd yet
    first.resync({PREFIX + "b0": _record("b0"), PREFIX + "b1": _record("b1", draining=True)})
    first.publish(now=True)
    later = _watcher(segment[1])
    assert later.seed_from_siblings() == 2
    assert sorted(later.table.backend_ids()) == ["b0", "b1"]
    assert later.table.state("b1").draining and not later.table.state("b0").draining

    # a delete (and a put) applied by the first worker reach the view, not only a resync
    first.resync({PREFIX + "b1": _record("b1"), PREFIX + "b2": _record("b2")})
    first.publish(now=True)
    third = _watcher(segment[1])
    assert third.seed_from_siblings() == 2
    assert sorted(third.table.backend_ids()) == ["b1", "b2"]
    # the seeded worker's own first etcd read replaces the view's records
    third.resync({PREFIX + "b2": _record("b2")})
    assert third.table.backend_ids() == ["b2"]


def test_one_process_has_no_view() -> None:
    alone = _watcher(None)
    assert alone.seed_from_siblings() == 0
    alone.resync({PREFIX + "b0": _record("b0")})
    alone.publish()  # nothing to write to: no error
    assert alone.table.backend_ids() == ["b0"]


def test_the_view_is_written_at_most_once_a_second_and_without_health(
    segment: list[SharedLoad],
) -> None:
    """An agent rewrites its record as its node health changes: a worker writes the
    view after a full read, then at most every PUBLISH_S, and at once when asked (etcd
    went away); a change of health readings alone changes nothing in the view."""
    w = _watcher(segment[0])
    w.resync({PREFIX + "b0": _record("b0")})
    w.publish(now=True)
    with segment[1].registry_doc() as view:
        first = dict(view)
    assert list(first) == [PREFIX + "b0"] and '"health":null' in first[PREFIX + "b0"]
    w.resync({PREFIX + "b0": _record("b0", score=0.9)})  # health readings only
    assert not w._dirty
    w.resync({PREFIX + "b0": _record("b0"), PREFIX + "b1": _record("b1")})
    w.publish()  # within PUBLISH_S of the last write: held back
    with segment[1].registry_doc() as view:
        assert dict(view) == first
    w.publish(now=True)
    with segment[1].registry_doc() as view:
        assert sorted(view) == [PREFIX + "b0", PREFIX + "b1"]
