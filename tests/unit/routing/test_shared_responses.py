"""Responses API ids shared by the gateway's workers (``routing.shared_responses``):
what one worker's ``ResponseOwners`` learns, the others find; a worker that starts
later reads what its siblings learnt before; a lapped ring loses entries, never pins
an id to a wrong backend."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kiloserve.gateway.extra_apis import ResponseOwners
from kiloserve.routing.shared_load import LoadLayout, SharedLoad
from kiloserve.routing.shared_responses import SharedResponses, response_key


@pytest.fixture
def segment() -> Iterator[SharedLoad]:
    owner = SharedLoad.create(LoadLayout(workers=3, slots=8, ring=16, response_ring=8))
    yield owner
    owner.close()


def _owners(segment: SharedLoad, worker: int, loads: list[SharedLoad]) -> ResponseOwners:
    load = SharedLoad.attach(segment.name, worker)
    loads.append(load)
    owners = ResponseOwners()
    owners.share = SharedResponses(load)
    return owners


def test_an_id_one_worker_learnt_is_found_by_the_others(segment: SharedLoad) -> None:
    loads: list[SharedLoad] = []
    try:
        w0, w1 = _owners(segment, 0, loads), _owners(segment, 1, loads)
        w0.remember("resp_a", "twin0")
        w1.remember("resp_b", "twin2")
        assert w1.owner("resp_a") == "twin0"
        assert w0.owner("resp_b") == "twin2"
        assert w0.owner("resp_unknown") is None
        late = _owners(segment, 2, loads)  # started (or restarted) after both
        assert late.owner("resp_a") == "twin0" and late.owner("resp_b") == "twin2"
    finally:
        for load in loads:
            load.close()


def test_a_lapped_ring_loses_the_oldest_ids_and_pins_nothing_wrong(
    segment: SharedLoad,
) -> None:
    """The ring holds 4 entries per worker here (``response_ring=8`` words): of six ids
    written before the sibling reads, the last four are found, the first two lost."""
    loads: list[SharedLoad] = []
    try:
        w0, w1 = _owners(segment, 0, loads), _owners(segment, 1, loads)
        for i in range(6):
            w0.remember(f"resp_{i}", f"twin{i % 3}")
        assert [w1.owner(f"resp_{i}") for i in range(6)] == [
            None, None, "twin2", "twin0", "twin1", "twin2",
        ]  # fmt: skip
        assert w1.share is not None and w1.share.num_lost == 2
    finally:
        for load in loads:
            load.close()


def test_an_entry_with_no_backend_behind_its_slot_is_dropped(segment: SharedLoad) -> None:
    loads: list[SharedLoad] = []
    try:
        w0, w1 = _owners(segment, 0, loads), _owners(segment, 1, loads)
        assert w0.share is not None and w1.share is not None
        q = loads[0].views[0]
        base = loads[0].layout.responses_at
        q[base + 1], q[base + 2] = response_key("resp_x"), 7  # slot 7: never claimed
        q[base] = 1
        assert w1.owner("resp_x") is None and w1.share.num_lost == 1
    finally:
        for load in loads:
            load.close()


def test_keys_are_the_same_in_every_process_and_fit_a_word() -> None:
    """Another interpreter (another string hash seed, as a sibling worker has) makes the
    same key: workers read each other's keys."""
    key = response_key("resp_abc")
    assert key != response_key("resp_abd") and -(1 << 63) <= key < (1 << 63)
    code = "from kiloserve.routing.shared_responses import response_key as k; print(k('resp_abc'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True)
    assert int(out.stdout) == key
