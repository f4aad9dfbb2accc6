"""One admission order per pool across the gateway's workers (``--workers N``).

Each worker keeps its own ``PoolQueue`` of the requests the kernel gave it, and the
pool's capacity is one budget for all of them (``routing.shared_load``). What the
budget alone did not give was one order: a worker whose completion freed room granted
its own waiter even when a sibling's had waited longer, and a request arriving at a
worker with an empty queue went straight in past the siblings' waiters.

Each worker publishes, per pool, the head of its queue in the load segment: how many
wait, the highest priority among them and the oldest arrival at that priority
(``time.monotonic()``, one clock for every process of the host). Before it releases a
waiter, a worker asks ``outranked``: when a sibling's head comes first (a higher
priority, or the same priority and an earlier arrival), it leaves the room to that
sibling, which releases at its next pump (its completions, and every
``admission.tick_s``). It waits so at most ``max_defer_s`` for the same head (the
sibling's head may fit nowhere while its own would: then the room is not left idle).
An arrival goes straight in only when no sibling has a waiter of its priority or
higher (``waiting``). Each head also gives the worker's count per lane, so a lane's
bound (``max_queue_len``) is one bound for the gateway, not one per worker
(``in_lane``: the siblings' waiters in a lane; two workers that take the lane's last
place at the same instant may each queue one, so it is exceeded by at most one per
worker). A head published more than ``max_queue_wait_s`` + 1 s ago is
ignored: such a waiter has expired, so it is a dead worker's leftover (a replacement
clears its block before it serves: ``clear``).

Within a worker, lanes, tenants' fair shares and ageing order its queue as before;
across workers, priority and arrival order count.
"""

from __future__ import annotations

from kiloserve.routing.shared_load import QUEUE_WORDS, SharedLoad

__all__ = ["SharedQueues"]

_POOL = "\x00pool "  # slot names of pools (no backend id starts with a NUL)


class SharedQueues:
    """One worker's handle on the queue heads of the segment."""

    def __init__(self, load: SharedLoad, max_queue_wait_s: float) -> None:
        self._load = load
        self._q, self._d = load.views
        lay = load.layout
        self._blocks = [lay.queues_at + w * lay.slots * QUEUE_WORDS for w in range(lay.workers)]
        self._max_age_s = max_queue_wait_s + 1.0
        self._own: dict[int, tuple[int, int, float, tuple[int, ...]]] = {}

    def clear(self) -> None:
        """Forget this worker's heads (and a dead predecessor's with the same index)."""
        base = self._blocks[self._load.worker]
        n = self._load.layout.slots * QUEUE_WORDS
        self._q[base : base + n] = memoryview(bytes(8 * n)).cast("q")
        self._own.clear()

    def publish(
        self, model: str, count: int, priority: int, oldest_s: float, lanes: tuple[int, ...]
    ) -> None:
        """This worker's queue head for ``model``'s pool (``count`` 0: empty) and its
        count in each lane (``queue.LANES`` order)."""
        slot = self._load.slot(_POOL + model)
        head = (count, priority, oldest_s, lanes) if count else (0, 0, 0.0, (0, 0, 0))
        if slot is None or self._own.get(slot, (0, 0, 0.0, (0, 0, 0))) == head:
            return
        at = self._blocks[self._load.worker] + slot * QUEUE_WORDS
        self._q[at + 1] = head[1]
        self._d[at + 2] = head[2]
        for i, n in enumerate(head[3]):
            self._q[at + 3 + i] = n
        self._q[at] = head[0]
        self._own[slot] = head

    def _heads(self, model: str, now_s: float) -> list[tuple[int, float]]:
        slot = self._load.slot(_POOL + model)
        if slot is None:
            return []
        q, d, me = self._q, self._d, self._load.worker
        out = []
        for w, base in enumerate(self._blocks):
            at = base + slot * QUEUE_WORDS
            if w != me and q[at] > 0 and now_s - d[at + 2] <= self._max_age_s:
                out.append((q[at + 1], d[at + 2]))
        return out

    def outranked(self, model: str, priority: int, oldest_s: float, now_s: float) -> bool:
        """Whether a sibling's head comes before this worker's (``priority`` and the
        oldest arrival at it)."""
        return any(
            p > priority or (p == priority and t < oldest_s) for p, t in self._heads(model, now_s)
        )

    def waiting(self, model: str, priority: int, now_s: float) -> bool:
        """Whether a sibling has a waiter of ``priority`` or higher."""
        return any(p >= priority for p, _ in self._heads(model, now_s))

    def in_lane(self, model: str, lane: int, now_s: float) -> int:
        """How many of the siblings' waiters for ``model`` are in lane ``lane`` (its
        index in ``queue.LANES``)."""
        slot = self._load.slot(_POOL + model)
        if slot is None:
            return 0
        q, d, me = self._q, self._d, self._load.worker
        total = 0
        for w, base in enumerate(self._blocks):
            at = base + slot * QUEUE_WORDS
            if w != me and q[at] > 0 and now_s - d[at + 2] <= self._max_age_s:
                total += q[at + 3 + lane]
        return total
