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

The outlier detector's run of consecutive failures is one run across the workers, as
Envoy counts a host's over all its worker threads: every worker writes, per backend,
when its run last ended (a success, an ejection, a breaker that closed: ``note_reset``)
and the times of its last ``STREAK_RING`` failures (``note_failure``). The run a
failure extends is every worker's failures after the latest end any of them wrote, so
failures spread over N workers eject at the same count as in one process (before,
each worker counted its own run, and two stalls on each of two workers ejected
nothing). Times are ``time.monotonic()``, one clock for every process of the machine.
A worker counts at most ``STREAK_RING`` of a sibling's failures (its own run exactly):
thresholds above that count a sibling's share as ``STREAK_RING``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kiloserve.routing.shared_load import STREAK_RING, VERDICT_SLOT_WORDS, SharedLoad

__all__ = ["EJECT", "PROBE", "SharedVerdicts"]

PROBE, EJECT = 1, 2
_RESET, _TIMES = 2, 3  # a slot's words after (flags, weight lost)


class SharedVerdicts:
    """One worker's handle on the verdict blocks of the segment."""

    def __init__(self, load: SharedLoad) -> None:
        self._load = load
        self._q, self._d = load.views
        lay = load.layout
        self._blocks = [lay.verdicts_at + w * lay.verdict_words for w in range(lay.workers)]
        self._seen = [-1] * lay.workers
        self._own: dict[int, tuple[int, float]] = {}  # slot -> (flags, factor) published
        self._next_failure: dict[int, int] = {}  # slot -> failures written to its ring

    @property
    def worker(self) -> int:
        return self._load.worker

    def clear(self) -> None:
        """Forget this worker's verdicts (and a dead predecessor's with the same index)."""
        base = self._blocks[self._load.worker]
        n = self._load.layout.slots * VERDICT_SLOT_WORDS
        self._q[base + 1 : base + 1 + n] = memoryview(bytes(8 * n)).cast("q")
        self._q[base] += 1
        self._own.clear()
        self._next_failure.clear()

    def publish(self, backend_id: str, flags: int, factor: float) -> None:
        """This worker's verdict on a backend (``PROBE | EJECT`` flags, weight factor)."""
        slot = self._load.slot(backend_id)
        if slot is None or self._own.get(slot, (0, 1.0)) == (flags, factor):
            return
        base = self._blocks[self._load.worker]
        at = base + 1 + slot * VERDICT_SLOT_WORDS
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
                    at = b + 1 + slot * VERDICT_SLOT_WORDS
                    flags |= q[at]
                    lost = max(lost, d[at + 1])
            out[backend_id] = (flags, 1.0 - lost)
        return out

    # -- the outlier detector's failure run, across workers ----------------------------
    def note_reset(self, backend_id: str, now_s: float) -> None:
        """This worker's run of failures on the backend ended at ``now_s`` (a success,
        an ejection, a closed breaker): it ends every worker's failures before it."""
        slot = self._load.slot(backend_id)
        if slot is not None:
            base = self._blocks[self._load.worker] + 1 + slot * VERDICT_SLOT_WORDS
            self._d[base + _RESET] = now_s

    def note_failure(self, backend_id: str, now_s: float, own_run: int) -> int:
        """Record a failure at ``now_s``; ``own_run`` is this worker's run since its own
        last reset, this failure included. Returns the run over every worker: the
        failures of all of them after the latest reset any of them wrote."""
        slot = self._load.slot(backend_id)
        if slot is None:
            return own_run
        d, me, off = self._d, self._load.worker, 1 + slot * VERDICT_SLOT_WORDS
        i = self._next_failure.get(slot, 0)
        d[self._blocks[me] + off + _TIMES + i % STREAK_RING] = now_s
        self._next_failure[slot] = i + 1
        latest = max(d[b + off + _RESET] for b in self._blocks)
        run = 0
        for w, b in enumerate(self._blocks):
            if w == me and d[b + off + _RESET] >= latest:
                run += own_run  # exact: no sibling's reset came after this worker's
            else:
                at = b + off + _TIMES
                run += sum(1 for t in d[at : at + STREAK_RING] if t > latest)
        return run
