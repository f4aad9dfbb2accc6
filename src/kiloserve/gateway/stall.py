"""Stall detection for one relayed stream (docs/gateway.md, "Mid-stream failover").

A stream that goes silent for the stall timeout is closed from here; the proxy's relay
then sees its upstream end, and ``stalled`` tells it why (so it migrates the stream and
accounts the attempt as a 504 for outlier ejection).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from kiloserve.gateway.sse import SseRelay
from kiloserve.gateway.upstream import UpstreamResponse

__all__ = ["StallWatchdog", "StreamClock"]


class StreamClock(Protocol):
    """What the watchdog reads of an attempt: its loop and when its last chunk came."""

    loop: asyncio.AbstractEventLoop
    last_chunk_at: float


class StallWatchdog:
    """Stall detection: closes the upstream response once no event came for
    ``timeout_s`` (one timer per stream, re-armed from the last event's time: nothing is
    done per chunk); ``readany`` then ends and ``stalled`` says why.

    Until a token came (a chat stream's first event is the role chunk, which an engine
    may send before the prompt is even scheduled) the bound is the first-byte time-out:
    a queued request is not a stalled one."""

    __slots__ = ("att", "first_s", "handle", "min_events", "relay", "resp", "stalled", "timeout_s")

    def __init__(
        self, att: StreamClock, resp: UpstreamResponse, relay: SseRelay, timeout_s: float,
        first_s: float, min_events: int,
    ) -> None:  # fmt: skip
        self.att = att
        self.resp = resp
        self.relay = relay
        self.timeout_s = timeout_s
        self.first_s = max(first_s, timeout_s)
        self.min_events = min_events
        self.stalled = False
        self.handle = att.loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        limit_s = self.timeout_s if self.relay.num_events > self.min_events else self.first_s
        idle_s = self.att.loop.time() - self.att.last_chunk_at
        if idle_s >= limit_s:
            self.stalled = True
            self.resp.close()
        else:
            self.handle = self.att.loop.call_later(limit_s - idle_s, self._check)

    def cancel(self) -> None:
        self.handle.cancel()
