"""Gateways that act as one: in-flight and reservation counts shared through Redis.

Several gateways (or several gateways of several workers each) in front of the same
backends each see only their own requests; two of them behind an L4 balancer route as
two half-informed routers. With ``peers: {enabled: true}`` every gateway process
publishes **its own totals** per backend (the counters of ``routing.shared_load.FIELDS``:
in flight, outstanding prefill / decode tokens, admission grants and reservations) on
one Redis pub/sub channel, and adds every peer's latest totals to its table:

* a change is published at once when nothing was sent in the last ``flush_interval_s``
  (10 ms), else with the others of that interval, in one message when it ends: only
  the backends that changed, as absolute totals, so a lost message is corrected by the
  next one (the sooner a peer hears, the fewer decisions two gateways make on the same
  stale view);
* every ``snapshot_interval_s`` (1 s) a full snapshot doubles as a heartbeat;
* a peer silent for ``peer_timeout_s`` (3 s: it died, or its Redis link did) is
  forgotten: its counts are subtracted;
* when this gateway's own link to Redis fails it forgets every peer at once (each
  gateway falls back to its own view) and ``kiloserve_gateway_peers_connected`` reads
  0 until it reconnects; the peers' next snapshots restore the shared view.

Learned speeds too: each message also carries the samples this gateway's EWMAs learned
from since its last message (``"s"``: ``[backend, kind, value]``, at most
``MAX_SAMPLES_PER_MESSAGE``; ``policies.accounting.SAMPLE_KINDS``), and every peer feeds
them to its own EWMAs, so two gateways that each see half the traffic learn the
backends' speeds from all of it. A lost message loses its samples (an EWMA needs no
exact count); a gateway cut off from Redis learns from its own requests only.

Responses API ids too: each message carries the ids this gateway learnt since its last
message (``"r"``: ``[key, backend]``, the id's 64-bit hash as
``routing.shared_responses.response_key`` makes it), and every peer adds them to its
``ResponseOwners`` (``on_response``), so a ``previous_response_id`` follow-up through
another gateway reaches the backend that holds the conversation (within the channel's
delay: a Redis round trip, at most ``flush_interval_s`` in a burst). A lost message
loses its ids; that follow-up is then routed by the policy.

The workers of one gateway (``--workers N``) share through memory
(``routing.shared_load``): each worker is a Redis peer of its own for the other
gateways, and ignores the messages of its sibling workers (same ``instance``).

Redis is imported only when this is enabled (the ``redis`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kiloserve.gateway.peer_settings import PeerConfig
from kiloserve.gateway.tasks import stop_tasks
from kiloserve.policies.accounting import SAMPLE_KINDS, note_sample
from kiloserve.routing.shared_load import FIELDS
from kiloserve.routing.table import BackendTable

if TYPE_CHECKING:
    from kiloserve.policies.base import BackendState
    from kiloserve.routing.table import LoadShare

__all__ = ["PEERS_KEY", "PeerConfig", "PeerLoad", "PeerMetrics", "install_peers"]

logger = logging.getLogger(__name__)

_NF = len(FIELDS)
_ZERO = (0,) * _NF
# samples (and Responses ids) kept for the next message; more (Redis slow or down)
# drop the oldest
MAX_SAMPLES_PER_MESSAGE = 4096
_INT64 = range(-(1 << 63), 1 << 63)


class _Peer:
    __slots__ = ("counts", "last_seen_s")

    def __init__(self, now_s: float) -> None:
        self.counts: dict[str, tuple[int, ...]] = {}
        self.last_seen_s = now_s


def _apply(state: BackendState | None, diff: tuple[int, ...], sign: int = 1) -> None:
    if state is None:
        return
    for f, attr in enumerate(FIELDS):
        d = diff[f]
        if d:
            setattr(state, attr, getattr(state, attr) + sign * d)


def _learn(samples: Any, state_of: Callable[[str], BackendState | None]) -> None:
    """Feed a peer's samples (``[[backend, kind, value], ...]``) to the EWMAs; malformed
    entries are skipped."""
    if not isinstance(samples, list):
        return
    for entry in samples:
        if not (isinstance(entry, list) and len(entry) == 3):
            continue
        bid, kind, value = entry
        if not isinstance(bid, str) or not isinstance(kind, int) or isinstance(kind, bool):
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        state = state_of(bid)
        if state is not None and 0 <= kind < len(SAMPLE_KINDS) and math.isfinite(value):
            note_sample(state, kind, float(value))


class PeerLoad:
    """A ``LoadShare`` through Redis pub/sub, wrapping the workers' one (``inner``)."""

    def __init__(
        self,
        cfg: PeerConfig,
        redis_url: str,
        *,
        instance: str | None = None,
        inner: LoadShare | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.redis_url = redis_url
        self.instance = instance or uuid.uuid4().hex[:12]
        self.peer_id = f"{self.instance}:{os.getpid()}"
        self.inner = inner
        self._clock = clock
        self._own: dict[str, list[int]] = {}
        self._dirty: set[str] = set()
        self._samples: list[tuple[str, int, float]] = []
        self._responses: list[tuple[int, str]] = []
        # told every Responses id a peer learnt: (key, backend id) (gateway/app.py
        # binds it to the ResponseOwners)
        self.on_response: Callable[[int, str], None] | None = None
        self._wake = asyncio.Event()  # set by a change while the send loop idles
        self._peers: dict[str, _Peer] = {}
        self._inbox: list[dict[str, Any]] = []
        self._forget_all = False
        self._num_resyncs = 0
        self.connected = False
        self.num_sent = 0
        self.num_received = 0
        self.num_failures = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._redis: Any = None
        # the table to apply peers' messages to as they arrive (install_peers binds it);
        # unbound, they wait for the next pull
        self.state_of: Callable[[str], BackendState | None] | None = None

    def join_workers(self, inner: LoadShare, instance: str) -> None:
        """This process is a worker of ``kiloserve gateway --workers N``: its siblings
        share through ``inner`` (memory) and are ignored on the channel."""
        self.inner = inner
        self.instance = instance
        self.peer_id = f"{instance}:{os.getpid()}"

    # -- LoadShare ------------------------------------------------------------------
    def publish(self, backend_id: str, deltas: tuple[int, ...]) -> None:
        if self.inner is not None:
            self.inner.publish(backend_id, deltas)
        own = self._own.get(backend_id)
        if own is None:
            own = self._own[backend_id] = [0] * _NF
        for f in range(_NF):
            own[f] += deltas[f]
        self._dirty.add(backend_id)
        if not self._wake.is_set():
            self._wake.set()

    def publish_sample(self, backend_id: str, kind: int, value: float) -> None:
        if self.inner is not None:
            self.inner.publish_sample(backend_id, kind, value)
        self._keep(self._samples, (backend_id, kind, value))

    def publish_response(self, key: int, backend_id: str) -> None:
        """A Responses API id this process learnt (its ``response_key``) for the peers."""
        self._keep(self._responses, (key, backend_id))

    def _keep(self, pending: list[Any], item: Any) -> None:
        """``item`` for the next message (the oldest dropped beyond the bound); wake the
        send loop."""
        if len(pending) >= MAX_SAMPLES_PER_MESSAGE:
            del pending[: len(pending) - MAX_SAMPLES_PER_MESSAGE + 1]
        pending.append(item)
        if not self._wake.is_set():
            self._wake.set()

    def pull(self, state_of: Callable[[str], BackendState | None]) -> None:
        if self.inner is not None:
            before = self.inner.num_resyncs
            self.inner.pull(state_of)
            if self.inner.num_resyncs != before:  # it set the counters to the workers' sums
                self._add_peers(state_of)
        self._drain(state_of)

    def _add_peers(self, state_of: Callable[[str], BackendState | None]) -> None:
        for peer in self._peers.values():
            for bid, counts in peer.counts.items():
                _apply(state_of(bid), counts)

    def _drain(self, state_of: Callable[[str], BackendState | None]) -> None:
        """Apply what arrived from the peers, forget the silent ones."""
        if self._forget_all:
            self._forget_all = False
            for pid in list(self._peers):
                self._forget(pid, state_of)
        if self._inbox:
            inbox, self._inbox = self._inbox, []
            for msg in inbox:
                self._take(msg, state_of)
        now = self._clock()
        for pid, peer in list(self._peers.items()):
            if now - peer.last_seen_s > self.cfg.peer_timeout_s:
                logger.info("peer gateway %s silent for %.1f s: forgotten", pid,
                            now - peer.last_seen_s)  # fmt: skip
                self._forget(pid, state_of)

    @property
    def num_resyncs(self) -> int:
        return self._num_resyncs

    def resync(self, state_of: Callable[[str], BackendState | None]) -> None:
        """After the inner share rebuilt the counters (or for a new backend): the
        peers' counts on top again."""
        self._num_resyncs += 1
        if self.inner is not None:
            self.inner.resync(state_of)
        else:  # the counters are this process's own plus the peers'
            names = set(self._own).union(*(p.counts for p in self._peers.values()))
            for bid in names:
                s = state_of(bid)
                if s is not None:
                    own = self._own.get(bid, _ZERO)
                    for f, attr in enumerate(FIELDS):
                        setattr(s, attr, own[f])
        self._add_peers(state_of)

    def set_draining(self, backend_id: str, draining: bool) -> None:
        if self.inner is not None:
            self.inner.set_draining(backend_id, draining)

    # -- peers' messages -------------------------------------------------------------
    def _take(self, msg: dict[str, Any], state_of: Callable[[str], BackendState | None]) -> None:
        pid = str(msg.get("id", ""))
        if not pid or pid == self.peer_id or msg.get("inst") == self.instance:
            return  # ourselves, or a sibling worker (shared through memory)
        peer = self._peers.get(pid)
        if peer is None:
            peer = self._peers[pid] = _Peer(self._clock())
            logger.info("peer gateway %s joined", pid)
        peer.last_seen_s = self._clock()
        _learn(msg.get("s"), state_of)
        self._learn_responses(msg.get("r"))
        backends = msg.get("b") or {}
        for bid, raw in backends.items():
            new = tuple(int(v) for v in raw[:_NF])
            if len(new) != _NF:
                continue
            old = peer.counts.get(bid, _ZERO)
            _apply(state_of(bid), tuple(n - o for n, o in zip(new, old, strict=True)))
            if any(new):
                peer.counts[bid] = new
            else:
                peer.counts.pop(bid, None)
        if msg.get("full"):  # a snapshot: what it no longer lists is zero
            for bid in [b for b in peer.counts if b not in backends]:
                _apply(state_of(bid), peer.counts.pop(bid), -1)

    def _learn_responses(self, entries: Any) -> None:
        """A peer's Responses ids (``[[key, backend], ...]``) to ``on_response``;
        malformed entries are skipped."""
        if not isinstance(entries, list) or self.on_response is None:
            return
        for entry in entries:
            if isinstance(entry, list) and len(entry) == 2:
                key, bid = entry
                if type(key) is int and key in _INT64 and isinstance(bid, str) and bid:
                    self.on_response(key, bid)

    def _forget(self, pid: str, state_of: Callable[[str], BackendState | None]) -> None:
        peer = self._peers.pop(pid, None)
        if peer is not None:
            for bid, counts in peer.counts.items():
                _apply(state_of(bid), counts, -1)

    @property
    def num_peers(self) -> int:
        """Peer gateways in the view: a gateway with N workers sends as N processes
        (``INSTANCE:PID``), counted once (before: N times)."""
        return len({pid.rsplit(":", 1)[0] for pid in self._peers})

    # -- the Redis side ----------------------------------------------------------------
    def _message(self, *, full: bool) -> bytes | None:
        if full:
            names = list(self._own)
        elif self._dirty or self._samples or self._responses:
            names = list(self._dirty)
        else:
            return None
        self._dirty.clear()
        body = {bid: self._own[bid] for bid in names if bid in self._own}
        # totals that reached zero are dropped from the next snapshots
        for bid in [b for b in names if not any(self._own.get(b, _ZERO))]:
            self._own.pop(bid, None)
        msg: dict[str, Any] = {"id": self.peer_id, "inst": self.instance, "full": full, "b": body}
        if self._samples:
            msg["s"], self._samples = self._samples, []
        if self._responses:
            msg["r"], self._responses = self._responses, []
        return orjson.dumps(msg)

    async def start(self) -> None:
        redis_asyncio = importlib.import_module("redis.asyncio")
        self._redis = redis_asyncio.Redis.from_url(self.redis_url, socket_timeout=2.0)
        self._tasks = [
            asyncio.ensure_future(self._send_loop()),
            asyncio.ensure_future(self._receive_loop()),
        ]

    async def stop(self) -> None:
        await stop_tasks(self._tasks)  # bounded: a task may swallow its cancel
        self._tasks = []
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    def _lost(self, exc: BaseException) -> None:
        if self.connected:
            logger.warning("peer channel %s lost (%s): routing on this gateway's own view",
                           self.redis_url, exc)  # fmt: skip
        self.connected = False
        self.num_failures += 1
        self._forget_all = True
        if self.state_of is not None:
            self._drain(self.state_of)

    async def _send_loop(self) -> None:
        """Send a change at once after a quiet spell; while changes keep coming, at most
        one message per ``flush_interval_s``; a full snapshot every
        ``snapshot_interval_s``."""
        next_full = 0.0
        while True:
            now = self._clock()
            full = now >= next_full
            msg = self._message(full=full)
            if full:
                next_full = now + self.cfg.snapshot_interval_s
            if msg is None:  # idle until a change (publish) or the next snapshot
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, next_full - self._clock())):
                        await self._wake.wait()
                continue
            try:
                await self._redis.publish(self.cfg.channel, msg)
                self.num_sent += 1
            except Exception as exc:
                self._lost(exc)
                next_full = 0.0  # resend everything once it is back
                await asyncio.sleep(min(1.0, self.cfg.snapshot_interval_s))
                continue
            await asyncio.sleep(self.cfg.flush_interval_s)

    async def _receive_loop(self) -> None:
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.cfg.channel)
                if not self.connected:
                    logger.info("peer channel %s connected", self.redis_url)
                self.connected = True
                while True:
                    got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if got is not None and got.get("type") == "message":
                        with contextlib.suppress(orjson.JSONDecodeError):
                            msg = orjson.loads(got["data"])
                            if isinstance(msg, dict):
                                self._inbox.append(msg)
                                self.num_received += 1
                    if self.state_of is not None:
                        self._drain(self.state_of)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(exc)
                await asyncio.sleep(min(1.0, self.cfg.snapshot_interval_s))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


class PeerMetrics(Collector):
    """``kiloserve_gateway_peers_connected``, ``_peers`` and the message counters."""

    def __init__(self, peers: PeerLoad) -> None:
        self._p = peers

    def collect(self) -> Iterator[Any]:
        p = self._p
        yield GaugeMetricFamily(
            "kiloserve_gateway_peers_connected",
            "1 while the peer channel (Redis) works; 0: routing on this gateway's own view",
            value=1.0 if p.connected else 0.0,
        )
        yield GaugeMetricFamily(
            "kiloserve_gateway_peers",
            "peer gateways whose counts are in the view",
            value=float(p.num_peers),
        )
        msgs = CounterMetricFamily(
            "kiloserve_gateway_peer_messages", "load messages", labels=["direction"]
        )
        msgs.add_metric(["sent"], float(p.num_sent))
        msgs.add_metric(["received"], float(p.num_received))
        yield msgs
        yield CounterMetricFamily(
            "kiloserve_gateway_peer_channel_failures",
            "peer channel failures (each one falls back to the own view)",
            value=float(p.num_failures),
        )


PEERS_KEY = web.AppKey("kiloserve_gateway_peers", PeerLoad)


def install_peers(
    app: web.Application,
    cfg: PeerConfig,
    redis_url: str,
    table: BackendTable,
    registry: CollectorRegistry,
) -> PeerLoad:
    """Share ``table``'s in-flight view with the other gateways on the channel: the
    table publishes through it, its metrics join ``registry``, and the app starts and
    stops its Redis tasks."""
    peers = PeerLoad(cfg, redis_url)
    table.shared = peers
    peers.state_of = table.state_or_none
    app[PEERS_KEY] = peers
    registry.register(PeerMetrics(peers))

    async def on_startup(_: web.Application) -> None:
        await peers.start()

    async def on_cleanup(_: web.Application) -> None:
        await peers.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return peers
