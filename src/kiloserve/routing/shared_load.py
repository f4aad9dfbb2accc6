"""One exact in-flight view for the gateway's worker processes (``--workers N``).

Each worker routes on a ``BackendTable`` of its own; what must agree across workers
is the load the gateway itself put on each backend: requests in flight and the prefill
and decode tokens they still owe (``policies.accounting``), the admission controller's
grants and KV reservations (so a pool's capacity is one budget for all workers), and
the operator's drains.
They live in one shared-memory segment (``multiprocessing.shared_memory``):

* a **name table**: slot -> backend id, claimed once per backend under a lock;
* per worker, a **row** of its own counts per slot and a **ring** of its changes
  ``(slot, field, delta)`` and of its learned samples ``(slot, _NF + kind, value as a
  float64)``. Only that worker writes its row and ring (single writer, no
  lock on the hot path): it writes the entry, then its row, then publishes the ring's
  write index, inside a sequence counter (odd while writing) so a reader can take a
  consistent copy of the row and the index together;
* a **drain** word per slot and an admin version, bumped on every drain / undrain;
* each worker's private loopback **port** (its own ``/metrics`` for the merged page);
* per slot, the last **scrape** of the backend (worker 0 scrapes, the others read it,
  each falling back to its own scrape when that record grows old: gateway/scrape.py);
* the **rate-limit buckets** (JSON, read and written under the lock);
* per worker, its **health verdicts** per slot and the times of its last failures on
  each backend (outlier streaks: ``routing.shared_verdicts``) and a ring
  of its **prefix placements** (``routing.shared_prefixes``), and the head of each of
  its admission queues (``gateway/admission/shared_queue.py``);
* the **LoRA log** of adapter loads and claims (JSON under the lock, with a version
  word read without it: ``gateway/lora_shared.py``);
* the **registry view**: the etcd registry's records as last seen by a worker (JSON
  under the lock, ``key -> record``), so a worker that starts while etcd is down (one
  that replaces a dead worker) routes to the backends its siblings know
  (``gateway/registry/watch.py``);
* per worker, a ring of the **Responses API ids** it relayed and their backends
  (``routing.shared_responses``).

``publish`` records this worker's change (called by the table right after the
accounting changed its own state, with the exact delta it applied). ``pull`` applies
every peer's changes since the last pull to this worker's states (called before each
routing decision and before every read of the table), so each worker's
``BackendState`` counters are the sum over all workers, exact up to the changes a peer
makes while a decision runs. ``publish_sample`` records a sample this worker's EWMAs
learned from (a dispatch's prefill work, a TTFT, a TPOT: ``policies.accounting``);
``pull`` feeds the peers' samples to this worker's EWMAs (``note_sample``) and to
``on_sample`` (the slow-node demoter's windows), so every worker learns the backends'
speeds from all of the gateway's traffic, not its share.
A reader that fell more than a ring behind (a stalled worker) rebuilds its view from
the rows (the EWMAs keep what they learned). A worker that replaces a dead one first
retires what the dead one still counted (its row, published as negative changes), so
requests that died with it stop counting everywhere.

What stays per worker: the active health probes and the outlier and slow-node state
machines (their verdicts and failure streaks are shared: ``routing.shared_verdicts``),
the approximate prefix index (each keeps its own, fed with the siblings' placements:
``routing.shared_prefixes``), and the admission queues (each worker queues its own
requests against the shared budget, in one order across workers:
``gateway/admission/shared_queue.py``); see docs/gateway.md ("Workers").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING

from kiloserve.policies.accounting import SAMPLE_KINDS, note_sample
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.file_lock import FileLock
from kiloserve.routing.shared_json import JsonAreas

if TYPE_CHECKING:
    from kiloserve.policies.base import BackendState

__all__ = [
    "FIELDS",
    "QUEUE_WORDS",
    "SCRAPE_FAILED",
    "SCRAPE_OK",
    "SCRAPE_UNAVAILABLE",
    "STREAK_RING",
    "VERDICT_SLOT_WORDS",
    "FileLock",
    "LoadLayout",
    "SharedLoad",
]

logger = logging.getLogger(__name__)

# the shared counters, in row order (BackendState attributes): the accounting's, then
# the admission controller's
FIELDS = (
    "in_flight",
    "outstanding_prefill_tokens",
    "outstanding_decode_tokens",
    "admitted_in_flight",
    "reserved_tokens",
    "undispatched_tokens",
)
_NF = len(FIELDS)
_MAGIC = 0x4B494C4F4C4F4144  # "KILOLOAD"
_HEADER = 10  # magic, workers, slots, ring, admin version, bucket bytes, prefix ring, lora,
# registry bytes, response ring
_NAME_BYTES = 248
_NAME_WORDS = 1 + _NAME_BYTES // 8  # length word + utf-8 bytes
_ENTRY = 3  # slot, field, delta
_DRAIN_SET, _DRAIN_CLEAR = 1, 2
# a scrape record: seq, outcome, time (f64), 8 EngineMetrics numbers (f64, NaN = None),
# engine name (16 bytes), failure reason (32 bytes)
_NUMS = EngineMetrics.NUMBERS
_SCRAPE_WORDS = 3 + len(_NUMS) + 2 + 4
SCRAPE_OK, SCRAPE_UNAVAILABLE, SCRAPE_FAILED = 1, 2, 3
_CREATED: set[str] = set()  # segments this process created (and its tracker unlinks)
# a queue head per worker and pool: count, priority, oldest arrival (f64), and the
# count in each lane (short, medium, long; gateway/admission/shared_queue.py)
QUEUE_WORDS = 6
# a worker's verdict per slot: flags, weight lost, the time its failure streak on the
# backend last ended (f64) and a ring of its last STREAK_RING failure times (f64)
STREAK_RING = 16
VERDICT_SLOT_WORDS = 3 + STREAK_RING


@dataclass(frozen=True, slots=True)
class LoadLayout:
    """Sizes of the segment (in 8-byte words) for ``workers`` x ``slots`` x ``ring``."""

    workers: int
    slots: int = 4096
    ring: int = 65536
    bucket_bytes: int = 1 << 20  # the rate-limit buckets (JSON, under the lock)
    prefix_ring: int = 1 << 18  # words per worker for its prefix placements
    lora_bytes: int = 1 << 20  # the LoRA log and last-request times (JSON, under the lock)
    registry_bytes: int = 4 << 20  # the registry view (JSON, under the lock: ~250 B a backend)
    response_ring: int = 1 << 18  # words per worker: (id hash, slot) of its Responses ids

    @property
    def names_at(self) -> int:
        return _HEADER

    @property
    def drains_at(self) -> int:
        return self.names_at + self.slots * _NAME_WORDS

    @property
    def ports_at(self) -> int:
        return self.drains_at + self.slots

    @property
    def scrapes_at(self) -> int:
        return self.ports_at + self.workers

    @property
    def workers_at(self) -> int:
        return self.scrapes_at + self.slots * _SCRAPE_WORDS

    @property
    def worker_words(self) -> int:
        return 2 + self.slots * _NF + self.ring * _ENTRY  # seq, index, row, ring

    def worker_at(self, w: int) -> int:
        return self.workers_at + w * self.worker_words

    @property
    def buckets_at(self) -> int:
        return self.workers_at + self.workers * self.worker_words

    @property
    def verdicts_at(self) -> int:
        return self.buckets_at + 1 + self.bucket_bytes // 8

    @property
    def verdict_words(self) -> int:
        # version, then per slot: flags, weight lost, streak reset time, failure times
        return 1 + self.slots * VERDICT_SLOT_WORDS

    @property
    def prefixes_at(self) -> int:
        return self.verdicts_at + self.workers * self.verdict_words

    @property
    def queues_at(self) -> int:
        return self.prefixes_at + self.workers * (1 + self.prefix_ring)

    @property
    def lora_at(self) -> int:  # version, length, then the JSON bytes
        return self.queues_at + self.workers * self.slots * QUEUE_WORDS

    @property
    def registry_at(self) -> int:  # length, then the JSON bytes
        return self.lora_at + 2 + self.lora_bytes // 8

    @property
    def responses_at(self) -> int:  # per worker: entries written, then its ring
        return self.registry_at + 1 + self.registry_bytes // 8

    @property
    def words(self) -> int:
        return self.responses_at + self.workers * (1 + self.response_ring)


def _buf(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # closed
        raise ValueError(f"shared memory {shm.name!r} is closed")
    return buf


class SharedLoad(JsonAreas):
    """One worker's handle on the segment (see the module docstring).

    ``create`` makes the segment (the supervisor); ``attach`` opens it in a worker.
    ``lock`` is a cross-process lock (``FileLock``) for claiming slots, drains and the
    rate-limit buckets, never taken on the hot path; None in a single process (tests).
    """

    def __init__(
        self,
        shm: shared_memory.SharedMemory,
        layout: LoadLayout,
        worker: int,
        lock: AbstractContextManager[object] | None,
        *,
        owner: bool = False,
    ) -> None:
        self._shm = shm
        self.layout = layout
        self.worker = worker
        self._lock: AbstractContextManager[object] = lock if lock is not None else nullcontext()
        self._owner = owner
        self._raw = _buf(shm)
        self._q = self._raw.cast("q")
        self._d = self._raw.cast("d")  # the same words, as float64
        self._slots: dict[str, int] = {}  # backend id -> slot (claimed)
        self._names: dict[int, str] = {}  # slot -> backend id
        self._cursors = [0] * layout.workers
        # word offsets of every worker's block and ring (the hot path reads them)
        self._bases = [layout.worker_at(w) for w in range(layout.workers)]
        self._rings = [b + 2 + layout.slots * _NF for b in self._bases]
        self._admin_seen = -1
        self._full_warned = False
        self._num_resyncs = 0
        # told every sibling's sample ``pull`` applies: (backend id, kind, value); the
        # slow-node demoter's (gateway/resilience/manager.py: ``on_sibling_sample``)
        self.on_sample: Callable[[str, int, float], None] | None = None

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def create(
        cls, layout: LoadLayout, lock: AbstractContextManager[object] | None = None
    ) -> SharedLoad:
        shm = shared_memory.SharedMemory(create=True, size=layout.words * 8)
        _CREATED.add(shm.name)
        q = _buf(shm).cast("q")
        q[1], q[2], q[3] = layout.workers, layout.slots, layout.ring
        q[5] = layout.bucket_bytes
        q[6] = layout.prefix_ring
        q[7] = layout.lora_bytes
        q[8] = layout.registry_bytes
        q[9] = layout.response_ring
        q[0] = _MAGIC
        q.release()
        return cls(shm, layout, -1, lock, owner=True)

    @classmethod
    def attach(
        cls, name: str, worker: int, lock: AbstractContextManager[object] | None = None
    ) -> SharedLoad:
        shm = shared_memory.SharedMemory(name=name)
        # the creator owns (and unlinks) it: before 3.13 attaching registers it with this
        # process's resource tracker, which would unlink it when this process exits
        if shm.name not in _CREATED:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        q = _buf(shm).cast("q")
        if q[0] != _MAGIC:
            q.release()
            shm.close()
            raise ValueError(f"shared memory {name!r} is not a kiloserve load segment")
        layout = LoadLayout(
            workers=q[1], slots=q[2], ring=q[3], bucket_bytes=q[5], prefix_ring=q[6],
            lora_bytes=q[7], registry_bytes=q[8], response_ring=q[9],
        )  # fmt: skip
        q.release()
        if not 0 <= worker < layout.workers:
            shm.close()
            raise ValueError(f"worker {worker} outside 0..{layout.workers - 1}")
        return cls(shm, layout, worker, lock)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def num_resyncs(self) -> int:
        return self._num_resyncs

    @property
    def views(self) -> tuple[memoryview[int], memoryview[float]]:
        """The segment's words as int64 and as float64 (``routing.shared_verdicts``)."""
        return self._q, self._d

    def close(self) -> None:
        self._q.release()
        self._d.release()
        self._raw.release()
        self._shm.close()
        if self._owner:
            self._shm.unlink()
            _CREATED.discard(self._shm.name)

    # -- slots -----------------------------------------------------------------------
    def _read_name(self, slot: int) -> str:
        at = self.layout.names_at + slot * _NAME_WORDS
        n = self._q[at]
        if n <= 0:
            return ""
        raw = self._raw[(at + 1) * 8 : (at + 1) * 8 + n]
        return bytes(raw).decode("utf-8", "replace")

    def slot(self, backend_id: str) -> int | None:
        """The backend's slot, claimed on first use; None when the table is full."""
        got = self._slots.get(backend_id)
        if got is not None:
            return got
        key = backend_id.encode()[:_NAME_BYTES]
        with self._lock:
            free = None
            for s in range(self.layout.slots):
                name = self._read_name(s)
                if not name:
                    free = s
                    break
                if name.encode() == key:
                    self._remember(s, name)
                    return s
            if free is None:
                if not self._full_warned:
                    logger.warning("shared load: all %d slots used; %s is counted per worker",
                                   self.layout.slots, backend_id)  # fmt: skip
                    self._full_warned = True
                return None
            at = self.layout.names_at + free * _NAME_WORDS
            self._raw[(at + 1) * 8 : (at + 1) * 8 + len(key)] = key
            self._q[at] = len(key)
        self._remember(free, backend_id)
        return free

    def _remember(self, slot: int, backend_id: str) -> None:
        self._slots[backend_id] = slot
        self._names[slot] = backend_id

    def slot_name(self, slot: int) -> str:
        """The backend id of a claimed slot ("" when free)."""
        return self._slot_name(slot)

    def _slot_name(self, slot: int) -> str:
        got = self._names.get(slot)
        if got is None:
            got = self._read_name(slot)
            if got:
                self._remember(slot, got)
        return got

    # -- this worker's changes (hot path) --------------------------------------------
    def publish(self, backend_id: str, deltas: tuple[int, ...]) -> None:
        """Record this worker's change of ``FIELDS`` for a backend (zeros skipped)."""
        slot = self.slot(backend_id)
        if slot is None:
            return
        q, lay = self._q, self.layout
        base, ring = self._bases[self.worker], self._rings[self.worker]
        row = base + 2 + slot * _NF
        i = q[base + 1]
        q[base] += 1  # odd: writing
        for f in range(_NF):
            d = deltas[f]
            if d:
                e = ring + (i % lay.ring) * _ENTRY
                q[e] = slot
                q[e + 1] = f
                q[e + 2] = d
                q[row + f] += d
                i += 1
        q[base + 1] = i
        q[base] += 1  # even: consistent

    def publish_sample(self, backend_id: str, kind: int, value: float) -> None:
        """Record a sample this worker's EWMAs learned from (``SAMPLE_*`` ``kind``):
        a ring entry of its own, no row change."""
        slot = self.slot(backend_id)
        if slot is None or not 0 <= kind < len(SAMPLE_KINDS):
            return
        q, lay = self._q, self.layout
        base = self._bases[self.worker]
        i = q[base + 1]
        e = self._rings[self.worker] + (i % lay.ring) * _ENTRY
        q[base] += 1  # odd: writing
        q[e] = slot
        q[e + 1] = _NF + kind
        self._d[e + 2] = value
        q[base + 1] = i + 1
        q[base] += 1  # even: consistent

    # -- peers' changes ---------------------------------------------------------------
    def pull(self, state_of: Callable[[str], BackendState | None]) -> None:
        """Apply every peer's changes since the last pull (and new drains)."""
        q, lay = self._q, self.layout
        if q[4] != self._admin_seen:
            self._apply_drains(state_of)
        for w in range(lay.workers):
            if w == self.worker:
                continue
            base, ring = self._bases[w], self._rings[w]
            end, start = q[base + 1], self._cursors[w]
            if end == start:
                continue
            if end - start > lay.ring:
                self.resync(state_of)
                return
            for i in range(start, end):
                e = ring + (i % lay.ring) * _ENTRY
                slot, f = q[e], q[e + 1]
                name = self._slot_name(slot)
                s = state_of(name) if name else None
                if s is None:
                    continue
                if f < _NF:
                    attr = FIELDS[f]
                    setattr(s, attr, getattr(s, attr) + q[e + 2])
                else:  # a sample (publish_sample)
                    note_sample(s, f - _NF, self._d[e + 2])
                    if self.on_sample is not None:
                        self.on_sample(name, f - _NF, self._d[e + 2])
            if q[base + 1] - start > lay.ring:  # overwritten while we read: start over
                self.resync(state_of)
                return
            self._cursors[w] = end

    def _row_copy(self, w: int) -> tuple[int, list[int]]:
        """(write index, row) of worker ``w``, consistent with each other."""
        q, lay = self._q, self.layout
        base = self._bases[w]
        while True:
            seq = q[base]
            if seq % 2:
                continue
            end = q[base + 1]
            row = list(q[base + 2 : base + 2 + lay.slots * _NF])
            if q[base] == seq:
                return end, row

    def resync(self, state_of: Callable[[str], BackendState | None]) -> None:
        """Rebuild this worker's counters from every worker's row (own row included)."""
        self._num_resyncs += 1
        totals = [0] * (self.layout.slots * _NF)
        for w in range(self.layout.workers):
            end, row = self._row_copy(w)
            self._cursors[w] = end
            for k, v in enumerate(row):
                if v:
                    totals[k] += v
        for slot in range(self.layout.slots):
            # a slot with counts, or one this worker knows (its counts may be back to 0)
            if slot not in self._names and not any(totals[slot * _NF : slot * _NF + _NF]):
                continue
            name = self._slot_name(slot)
            s = state_of(name) if name else None
            if s is not None:
                for f, attr in enumerate(FIELDS):
                    setattr(s, attr, totals[slot * _NF + f])
        self._apply_drains(state_of)

    def retire_predecessor(self) -> int:
        """Publish the negation of what this worker's row still counts (a dead worker
        that had this index); returns the number of slots retired."""
        q, lay = self._q, self.layout
        base = self._bases[self.worker]
        retired = 0
        for slot in range(lay.slots):
            row = base + 2 + slot * _NF
            vals = tuple(q[row + f] for f in range(_NF))
            if any(vals):
                name = self._slot_name(slot)
                if name:
                    self.publish(name, tuple(-v for v in vals))
                    retired += 1
        return retired

    # -- the workers' private ports (gateway/worker_metrics.py) -----------------------
    def set_port(self, port: int) -> None:
        """Publish this worker's private loopback port."""
        self._q[self.layout.ports_at + self.worker] = port

    def ports(self) -> list[tuple[int, int]]:
        """``(worker, private port)`` of every worker that published one."""
        at = self.layout.ports_at
        return [(w, self._q[at + w]) for w in range(self.layout.workers) if self._q[at + w]]

    # -- scrapes: one worker scrapes, the others read (gateway/scrape.py) -------------
    def put_scrape(
        self,
        backend_id: str,
        outcome: int,
        now_s: float,
        metrics: EngineMetrics | None = None,
        reason: str = "",
    ) -> None:
        """Publish one scrape's outcome (``SCRAPE_OK`` with its metrics,
        ``SCRAPE_UNAVAILABLE`` or ``SCRAPE_FAILED`` with a reason)."""
        slot = self.slot(backend_id)
        if slot is None:
            return
        q, d = self._q, self._d
        at = self.layout.scrapes_at + slot * _SCRAPE_WORDS
        q[at] += 1  # odd: writing
        q[at + 1] = outcome
        d[at + 2] = now_s
        for i, name in enumerate(_NUMS):
            v = getattr(metrics, name) if metrics is not None else None
            d[at + 3 + i] = math.nan if v is None else float(v)
        text_at = (at + 3 + len(_NUMS)) * 8
        engine = ((metrics.engine if metrics is not None else None) or "").encode()[:16]
        self._raw[text_at : text_at + 16] = engine.ljust(16, b"\0")
        self._raw[text_at + 16 : text_at + 48] = reason.encode()[:32].ljust(32, b"\0")
        q[at] += 1  # even: consistent

    def get_scrape(self, backend_id: str) -> tuple[int, float, EngineMetrics | None, str] | None:
        """The last published scrape of a backend: (outcome, time, metrics, reason)."""
        slot = self.slot(backend_id)
        if slot is None:
            return None
        q, d = self._q, self._d
        at = self.layout.scrapes_at + slot * _SCRAPE_WORDS
        for _ in range(100):
            seq = q[at]
            if seq == 0:
                return None
            if seq % 2:
                continue
            outcome, t = q[at + 1], d[at + 2]
            nums = [d[at + 3 + i] for i in range(len(_NUMS))]
            text_at = (at + 3 + len(_NUMS)) * 8
            engine = bytes(self._raw[text_at : text_at + 16]).rstrip(b"\0").decode(errors="replace")
            reason = (
                bytes(self._raw[text_at + 16 : text_at + 48]).rstrip(b"\0").decode(errors="replace")
            )
            if q[at] == seq:
                break
        else:
            return None
        if outcome != SCRAPE_OK:
            return outcome, t, None, reason
        f = [None if math.isnan(v) else v for v in nums]

        def whole(v: float | None) -> int | None:
            return None if v is None else int(v)

        metrics = EngineMetrics(
            engine=engine or None,
            num_running=whole(f[0]),
            num_waiting=whole(f[1]),
            kv_usage=f[2],
            prefix_hit_rate=f[3],
            num_preemptions=whole(f[4]),
            pcie_util=f[5],
            prefix_queries_tokens=f[6],
            prefix_hits_tokens=f[7],
        )
        return outcome, t, metrics, reason

    # -- drains ----------------------------------------------------------------------
    def set_draining(self, backend_id: str, draining: bool) -> None:
        slot = self.slot(backend_id)
        if slot is None:
            return
        with self._lock:
            self._q[self.layout.drains_at + slot] = _DRAIN_SET if draining else _DRAIN_CLEAR
            self._q[4] += 1

    def _apply_drains(self, state_of: Callable[[str], BackendState | None]) -> None:
        q, at = self._q, self.layout.drains_at
        self._admin_seen = q[4]
        for slot, flag in self._drain_flags(q, at):
            name = self._slot_name(slot)
            s = state_of(name) if name else None
            if s is not None:
                s.draining = flag == _DRAIN_SET

    def _drain_flags(self, q: memoryview, at: int) -> Iterator[tuple[int, int]]:
        for slot in range(self.layout.slots):
            flag = q[at + slot]
            if flag:
                yield slot, flag
