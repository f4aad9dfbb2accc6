"""Health verdicts shared by the gateway's worker processes (``--workers N``).

Each worker judges the backends from what it sees itself: its active health probes,
the outcomes of the requests it sent (outlier ejection) and their first tokens and
token times (slow-node demotion; ``gateway/resilience``). Without sharing, a backend
one worker ejected still got the other workers' traffic until each had met the same
failures on its own requests. Here every worker publishes its verdict per backend in
its own block of the load segment (``routing.shared_load``; single writer, no lock):

* ``PROBE`` (its probes failed) and ``EJECT`` (ejected or half-open) flags;
* the weight it lost to demotion (``1 - weight factor``; 0 when not demoted), so a
  zeroed block means "no verdict".

A block's version word is bumped after every change. ``changed`` compares the other
workers' versions with those last read (a few reads per tick), and ``peers`` returns,
per backend, the union of the others' flags and the largest weight any of them took
away: a backend one worker ejected is held out by all of them, a demotion by any worker
applies to all. A worker that replaces a dead one clears the block first (``clear``),
so the dead worker's verdicts stop counting.
"""

from __future__ import annotations

from collections.abc import Iterable

from kiloserve.routing.shared_load import SharedLoad

__all__ = ["EJECT", "PROBE", "SharedVerdicts"]

PROBE, EJECT = 1, 2


class SharedVerdicts:
    """One worker's handle on the verdict blocks of the segment."""

    def __init__(self, load: SharedLoad) -> None:
        self._load = load
        self._q, self._d = load.views
        lay = load.layout
        self._blocks = [lay.verdicts_at + w * lay.verdict_words for w in range(lay.workers)]
        self._seen = [-1] * lay.workers
        self._own: dict[int, tuple[int, float]] = {}  # slot -> (flags, factor) published

    @property
    def worker(self) -> int:
        return self._load.worker

    def clear(self) -> None:
        """Forget this worker's verdicts (and a dead predecessor's with the same index)."""
        base = self._blocks[self._load.worker]
        n = self._load.layout.slots * 2
        self._q[base + 1 : base + 1 + n] = memoryview(bytes(8 * n)).cast("q")
        self._q[base] += 1
        self._own.clear()

    def publish(self, backend_id: str, flags: int, factor: float) -> None:
        """This worker's verdict on a backend (``PROBE | EJECT`` flags, weight factor)."""
        slot = self._load.slot(backend_id)
        if slot is None or self._own.get(slot, (0, 1.0)) == (flags, factor):
            return
        base = self._blocks[self._load.worker]
        at = base + 1 + slot * 2
        self._q[at] = flags
        self._d[at + 1] = 1.0 - factor
        self._q[base] += 1
        self._own[slot] = (flags, factor)

    def changed(self) -> bool:
        """Whether another worker published since the last ``peers``."""
        q, me = self._q, self._load.worker
        return any(q[b] != self._seen[w] for w, b in enumerate(self._blocks) if w != me)

    def peers(self, backend_ids: Iterable[str]) -> dict[str, tuple[int, float]]:
        """The other workers' verdicts: backend -> (union of flags, smallest factor)."""
        q, d, me = self._q, self._d, self._load.worker
        for w, b in enumerate(self._blocks):
            self._seen[w] = q[b]  # read before the values: a later change shows next time
        out: dict[str, tuple[int, float]] = {}
        for backend_id in backend_ids:
            slot = self._load.slot(backend_id)
            if slot is None:
                continue
            flags, lost = 0, 0.0
            for w, b in enumerate(self._blocks):
                if w != me:
                    at = b + 1 + slot * 2
                    flags |= q[at]
                    lost = max(lost, d[at + 1])
            out[backend_id] = (flags, 1.0 - lost)
        return out
