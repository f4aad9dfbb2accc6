"""``Router.pins``: a pinned backend ranks first while routable and in the pool."""

from __future__ import annotations

import random

import pytest
from test_router import FixedPolicy, _info, _table

from kiloserve.routing.router import Router


@pytest.mark.parametrize(
    ("pin", "draining", "limit", "expected"),
    [
        (None, (), None, ("a", "b", "c")),
        ("c", (), None, ("c", "a", "b")),  # first, and not twice
        ("c", (), 2, ("c", "a")),
        ("c", ("c",), None, ("a", "b")),  # not routable: the policy's order
        ("other", (), None, ("a", "b", "c")),  # another model's pool: ignored
    ],
)
def test_pinned_backend_ranks_first(
    pin: str | None, draining: tuple[str, ...], limit: int | None, expected: tuple[str, ...]
) -> None:
    router = Router(_table(), FixedPolicy(("a", "b", "c"), []), random.Random(0))
    for backend_id in draining:
        router.table.set_draining(backend_id, True)
    if pin is not None:
        router.pins["r1"] = pin
    assert router.decide(_info("r1"), 0.0, limit=limit).ranked == expected
    assert router.decide(_info("r2"), 0.0).ranked[0] == "a"  # other requests: the policy's
