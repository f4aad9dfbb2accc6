"""Prefill legs whose KV blocks wait for their decode engine (the twin's P side).

A prefill leg (``kv_transfer_params.do_remote_decode``) finishes with its blocks still
allocated (``Sequence.hold_on_finish``). ``KvHolds`` keeps them under the request id
the answer names (``remote_request_id``) until the decode engine frees them
(``POST /kv_transfer/release``) or ``timeout_s`` passes (vLLM's
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default: a decode leg that never comes
must not hold blocks for ever). Either way ``EngineCore.release`` frees the blocks.
Timers run on the running asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DEFAULT_HOLD_TIMEOUT_S", "HeldKv", "KvHolds"]

logger = logging.getLogger(__name__)

DEFAULT_HOLD_TIMEOUT_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT


class ReleasingCore(Protocol):
    """What ``KvHolds`` needs of ``EngineCore``."""

    def release(self, seq_id: str) -> object: ...


@dataclass(slots=True, eq=False)
class HeldKv:
    """One held prefill: its engine sequence, block ids and expiry timer."""

    request_id: str
    seq_id: str
    block_ids: list[int]
    timer: asyncio.TimerHandle | None = None


class KvHolds:
    """The held prefills of one twin, by request id."""

    def __init__(
        self,
        core: ReleasingCore,
        timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
        on_expired: Callable[[HeldKv], None] | None = None,
    ) -> None:
        self._core = core
        self.timeout_s = timeout_s
        self._on_expired = on_expired
        self._held: dict[str, HeldKv] = {}
        # told after held blocks were freed (the twin's loop: a request waiting for
        # blocks may be scheduled now, not at its next idle poll)
        self.on_freed: Callable[[], None] | None = None
        self.num_released = 0  # by a decode engine
        self.num_expired = 0  # by the timeout

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

    @property
    def num_held_blocks(self) -> int:
        """Blocks the held prefills keep (as their answers listed them)."""
        return sum(len(held.block_ids) for held in self._held.values())

    def get(self, request_id: str) -> HeldKv | None:
        return self._held.get(request_id)

    def hold(self, request_id: str, seq_id: str, block_ids: list[int]) -> str:
        """Hold a finished prefill; returns the id it is held under (``request_id``, made
        unique with the sequence id if another prefill holds that id already)."""
        if request_id in self._held:
            request_id = f"{request_id}-{seq_id}"
        held = HeldKv(request_id, seq_id, list(block_ids))
        self._held[request_id] = held
        loop = asyncio.get_running_loop()
        held.timer = loop.call_later(self.timeout_s, self._expire, request_id)
        return request_id

    def release(self, request_id: str) -> HeldKv | None:
        """Free a held prefill's blocks (the decode engine has them); ``None``: not held
        (already released, expired, or never held here)."""
        held = self._free(request_id)
        if held is not None:
            self.num_released += 1
        return held

    def _expire(self, request_id: str) -> None:
        held = self._free(request_id)
        if held is None:
            return
        self.num_expired += 1
        logger.warning(
            "request %s: no decode engine fetched its KV within %.0f s; freed %d blocks",
            request_id,
            self.timeout_s,
            len(held.block_ids),
        )
        if self._on_expired is not None:
            self._on_expired(held)

    def _free(self, request_id: str) -> HeldKv | None:
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        if held.timer is not None:
            held.timer.cancel()
        self._core.release(held.seq_id)
        if self.on_freed is not None:
            self.on_freed()
        return held

    def close(self) -> None:
        """Free every held prefill (the twin stops)."""
        for request_id in list(self._held):
            self._free(request_id)
