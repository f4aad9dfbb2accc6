"""The shared segment's JSON areas (``routing.shared_load``): documents read and written
whole under the segment's lock, never on the hot path: the rate-limit buckets, the LoRA
log and the registry view."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiloserve.routing.shared_load import LoadLayout

__all__ = ["JsonAreas"]

logger = logging.getLogger(__name__)


class JsonAreas:
    """``SharedLoad``'s JSON documents (a length word, then the bytes; the LoRA log has
    a version word before it)."""

    layout: LoadLayout
    _lock: AbstractContextManager[object]
    _q: memoryview[int]
    _raw: memoryview

    @contextmanager
    def buckets(self) -> Iterator[dict[str, list[float]]]:
        """Every worker's rate-limit buckets (``key -> [level, updated_s, capacity]``), under the
        lock: changes to the dict are written back when the block ends. Times are
        ``time.monotonic()``, one clock for every process of the host."""
        with self._json(self.layout.buckets_at, self.layout.bucket_bytes, "rate-limit") as got:
            yield got

    @property
    def lora_version(self) -> int:
        """Bumped by every change of the LoRA log (read without the lock)."""
        return self._q[self.layout.lora_at]

    @contextmanager
    def lora_doc(self, *, bump: bool = True) -> Iterator[dict[str, Any]]:
        """The LoRA log (``gateway/lora_shared.py``) under the lock, written back (and,
        unless ``bump`` is False, ``lora_version`` bumped) when the block changed it.
        The version tells workers to apply new loads and unloads: a change they need
        not apply (last-request times) leaves it alone."""
        at = self.layout.lora_at
        version_at = at if bump else -1
        with self._json(at + 1, self.layout.lora_bytes, "LoRA", version_at=version_at) as got:
            yield got

    @contextmanager
    def registry_doc(self) -> Iterator[dict[str, Any]]:
        """The registry view (``key -> record``, ``gateway/registry/watch.py``) under the
        lock, written back when the block changed it."""
        with self._json(self.layout.registry_at, self.layout.registry_bytes, "registry") as got:
            yield got

    @contextmanager
    def _json(self, at: int, limit: int, what: str, version_at: int = -1) -> Iterator[Any]:
        with self._lock:
            n = self._q[at]
            raw = bytes(self._raw[(at + 1) * 8 : (at + 1) * 8 + n]) if n > 0 else b"{}"
            got = json.loads(raw)
            yield got
            out = json.dumps(got, separators=(",", ":")).encode()
            if out == raw:
                return
            if len(out) > limit:
                logger.warning("shared %s JSON over %d bytes: starting afresh", what, limit)
                out = b"{}"
            self._raw[(at + 1) * 8 : (at + 1) * 8 + len(out)] = out
            self._q[at] = len(out)
            if version_at >= 0:
                self._q[version_at] += 1
