"""Reading the siblings' rings of the load segment (``routing.shared_load``).

Each worker appends to a ring of its own and publishes how far it wrote (a count, at
the ring's base word); each reader keeps, per sibling, how far it read. ``unread``
gives the spans a reader has not read yet (``routing.shared_prefixes``,
``routing.shared_responses``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["unread"]


def unread(
    q: memoryview, bases: Sequence[int], cursors: Sequence[int], me: int
) -> Iterator[tuple[int, int, int, int]]:
    """``(worker, base, read up to, written up to)`` of each sibling (not ``me``) that
    wrote since its cursor."""
    for w, base in enumerate(bases):
        if w == me:
            continue
        end, pos = q[base], cursors[w]
        if end != pos:
            yield w, base, pos, end
