"""The two-worker shared segment fixture of the gateway's unit tests (imported by the
tests that use it: a ``conftest.py`` here would shadow the integration tests'
``from conftest import ...`` when both folders are collected together)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiloserve.routing.shared_load import LoadLayout, SharedLoad

__all__ = ["two_worker_segment"]


@pytest.fixture(name="segment")
def two_worker_segment() -> Iterator[list[SharedLoad]]:
    """One shared segment of two workers: each worker's handle (the supervisor's closed
    after them)."""
    owner = SharedLoad.create(LoadLayout(workers=2, slots=8, ring=16))
    handles = [SharedLoad.attach(owner.name, w) for w in (0, 1)]
    yield handles
    for h in handles:
        h.close()
    owner.close()
