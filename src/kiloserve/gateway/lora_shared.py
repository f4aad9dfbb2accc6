"""LoRA placement shared by the gateway's workers (``kiloserve gateway --workers N``).

Each worker keeps its own ``LoraPlacement`` (gateway/lora_placement.py): which adapters
each backend holds, learnt from the backends' ``/v1/models`` every
``discovery_interval_s`` and from the loads and unloads the worker made itself. Alone,
a worker learnt a sibling's load only at its next discovery, so two workers that missed
the same adapter within that interval each loaded it (often onto two backends). With
this, through the shared segment (``routing.shared_load``, ``SharedLoad.lora_doc``):

* **a log of loads and unloads**: every load or unload a worker makes is appended as
  ``[seq, backend, adapter, held]`` (the newest ``LOG_SIZE`` kept); before it looks for
  an adapter's holders a worker applies the entries it has not seen (a version word
  read without the lock says whether there are any), so a sibling's load is known at
  its next request, not its next discovery;
* **one load at a time per adapter**: a worker about to load an adapter first claims
  it (``loading``: adapter -> ``[worker, since]``); a sibling that misses the same
  adapter meanwhile waits for the claim to go (polling the version word every
  ``POLL_S``), then finds the adapter held and routes there. A claim older than its
  expiry (the caller's: three load timeouts, for a worker that died loading) is taken
  over.

* **last-request times**: a worker notes when each (backend, adapter) pair last served
  one of its requests, and writes what changed to ``used`` (``"backend\tadapter"`` ->
  time) at most every ``USE_FLUSH_S``; a worker about to unload adapters to make room
  first takes the siblings' times (the newest per pair), so the least recently
  requested adapter is the gateway's, not the one this worker's share of the requests
  used least (before, a worker could unload an adapter busy on its siblings). Times
  are ``time.monotonic()``, one clock for every process of the host.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kiloserve.gateway.lora_placement import LoraPlacement
from kiloserve.routing.shared_load import SharedLoad

__all__ = ["LOG_SIZE", "POLL_S", "USE_FLUSH_S", "SharedLora"]

LOG_SIZE = 256  # load / unload entries kept (a worker further behind relies on discovery)
POLL_S = 0.02  # how often a worker waiting on a sibling's load looks again
USE_FLUSH_S = 1.0  # a worker writes its last-request times at most this often
USE_KEEP_S = 3600.0  # times older than this leave the shared log (unknown = oldest)


class SharedLora:
    """One worker's view of the shared LoRA log and claims (see the module docstring)."""

    def __init__(
        self, shared: SharedLoad, worker: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.shared = shared
        self.worker = worker
        self.clock = clock
        self._version = -1  # the log's version last applied
        self._cursor = 0  # the last seq applied
        self.num_waits = 0  # loads left to a sibling that was loading the same adapter
        self._uses: dict[str, float] = {}  # "backend\tadapter" -> time, not written yet
        self._flushed_at = -USE_FLUSH_S

    def touch(self, name: str, holders: list[str], now_s: float) -> None:
        """Note that ``holders`` served a request for adapter ``name`` at ``now_s``;
        written to the segment at most every ``USE_FLUSH_S`` (one lock a second)."""
        for backend_id in holders:
            self._uses[f"{backend_id}\t{name}"] = now_s
        if now_s - self._flushed_at >= USE_FLUSH_S:
            self.flush_uses(now_s)

    def flush_uses(self, now_s: float) -> None:
        """Write this worker's unwritten last-request times (the newer of two wins)."""
        self._flushed_at = now_s
        if not self._uses:
            return
        with self.shared.lora_doc(bump=False) as doc:  # siblings' syncs need not re-read
            used: dict[str, float] = doc.setdefault("used", {})
            for key, t in self._uses.items():
                if t > used.get(key, -1.0):
                    used[key] = t
            for key in [k for k, t in used.items() if now_s - t > USE_KEEP_S]:
                del used[key]  # a pair no request named for an hour (or one gone)
        self._uses.clear()

    def take_uses(self, placement: LoraPlacement, now_s: float) -> None:
        """Apply every worker's last-request times to ``placement`` (before choosing
        which adapters to unload): the newest time per pair wins."""
        self.flush_uses(now_s)
        with self.shared.lora_doc() as doc:
            used = dict(doc.get("used", {}))
        for key, t in used.items():
            backend_id, _, name = key.partition("\t")
            placement.note_used(backend_id, name, float(t))

    def sync(self, placement: LoraPlacement) -> None:
        """Apply the siblings' loads and unloads this worker has not seen."""
        version = self.shared.lora_version
        if version == self._version:
            return
        with self.shared.lora_doc() as doc:
            events = list(doc.get("events", []))
            self._version = self.shared.lora_version
        known = set(placement.table.backend_ids())
        for seq, backend_id, name, held in events:
            if seq > self._cursor and backend_id in known:
                placement.set_held(backend_id, name, is_held=bool(held), now_s=self.clock())
            self._cursor = max(self._cursor, seq)

    def record(self, backend_id: str, name: str, *, held: bool) -> None:
        """Log a load (``held``) or an unload this worker made (already applied here);
        an unload also drops the pair's last-request time."""
        key = f"{backend_id}\t{name}"
        with self.shared.lora_doc() as doc:
            if not held:
                doc.get("used", {}).pop(key, None)
                self._uses.pop(key, None)
            seq = int(doc.get("seq", 0)) + 1
            doc["seq"] = seq
            events = doc.get("events", [])[-(LOG_SIZE - 1) :]
            doc["events"] = [*events, [seq, backend_id, name, held]]
        if seq == self._cursor + 1:  # nothing of the siblings' in between: seen
            self._cursor = seq

    async def claim(self, name: str, expiry_s: float, is_held: Callable[[], bool]) -> bool:
        """Claim the load of adapter ``name``: True once this worker holds the claim,
        False as soon as ``is_held()`` (which syncs the caller's placement) says a
        sibling's load made it held; asked before every try."""
        waited = False
        while True:
            if is_held():
                if waited:
                    self.num_waits += 1
                return False
            with self.shared.lora_doc() as doc:
                loading: dict[str, Any] = doc.setdefault("loading", {})
                owner = loading.get(name)
                now = self.clock()
                if owner is None or owner[0] == self.worker or now - float(owner[1]) > expiry_s:
                    loading[name] = [self.worker, now]
                    return True
            waited = True
            await asyncio.sleep(POLL_S)

    def release(self, name: str) -> None:
        """Give up this worker's claim on adapter ``name`` (after its load, done or not)."""
        with self.shared.lora_doc() as doc:
            loading = doc.get("loading", {})
            owner = loading.get(name)
            if owner is not None and owner[0] == self.worker:
                del loading[name]
