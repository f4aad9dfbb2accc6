"""The output-length history shared by every gateway through Redis (SPEC S1.1, seed 000).

A request without ``max_tokens`` is profiled with the EWMA of the output tokens its
(user, model) produced before (``profile.OutputPredictor``). Alone, each gateway
learns only from the requests it served; with a Redis URL (``output_history.redis_url``,
else ``rate_limit.redis_url``) and ``output_history.shared`` (default on) they learn
from all:

* a finished request updates this gateway's value at once (so prediction never waits
  on the network) and is queued; every ``flush_interval_s`` the queue goes to Redis in
  one pipeline: a Lua script folds each observation into the key's EWMA (atomically,
  whoever else writes), renews its TTL (``ttl_s``) and publishes the new value on
  ``channel``;
* every gateway subscribes to ``channel`` and takes each published value, so a user
  served by gateway A is predicted on gateway B within milliseconds;
* a (user, model) this gateway has no value for is fetched in the next flush (one
  ``HGET``), so values written before it started are found too: that first request
  gets the default.

Keys in Redis are SHA-256 digests of the (bounded) user and model, never the names.
When Redis is unreachable the gateway keeps predicting from its own observations,
``kiloserve_gateway_output_history_shared`` drops to 0, a WARNING says so once, and
writes are retried when it is back (pending ones beyond ``_MAX_PENDING`` are dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.output_history_settings import OutputHistoryConfig
from kiloserve.gateway.profile import OutputPredictor, bounded_key
from kiloserve.gateway.tasks import stop_tasks

__all__ = [
    "OutputHistoryConfig",
    "OutputHistoryMetrics",
    "SharedOutputPredictor",
    "install_output_history",
]

logger = logging.getLogger(__name__)

_MAX_PENDING = 10_000  # observations waiting for Redis; older ones are dropped
_MAX_FETCH = 1_000  # keys fetched per flush

# KEYS[1]: the hash; ARGV: observed tokens, alpha, ttl_s, channel, key digest
_OBSERVE_LUA = """
local old = tonumber(redis.call('HGET', KEYS[1], 'ewma'))
local x = tonumber(ARGV[1])
local new = x
if old then new = old + tonumber(ARGV[2]) * (x - old) end
redis.call('HSET', KEYS[1], 'ewma', tostring(new))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. tostring(new))
return tostring(new)
"""


def _digest(user: str | None, model: str) -> str:
    raw = f"{bounded_key(user or '')}\0{bounded_key(model)}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:32]


class SharedOutputPredictor(OutputPredictor):
    """``OutputPredictor`` whose values are shared with the other gateways (module doc)."""

    def __init__(
        self, cfg: OutputHistoryConfig, redis_url: str, default_tokens: int, alpha: float = 0.2
    ) -> None:
        super().__init__(default_tokens, alpha)
        self.cfg = cfg
        self.redis_url = redis_url
        self._values: OrderedDict[str, float] = OrderedDict()  # digest -> EWMA (LRU)
        self._pending: deque[tuple[str, int]] = deque(maxlen=_MAX_PENDING)
        self._to_fetch: dict[str, None] = {}  # ordered set of digests
        # digests fetched once already (hit or miss), bounded as the values are (LRU)
        self._asked: OrderedDict[str, None] = OrderedDict()
        self._redis: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.is_shared = False
        self.num_failures = 0
        self.num_written = 0
        self.num_received = 0

    # -- the hot path (no I/O) ------------------------------------------------------
    def _set(self, digest: str, value: float) -> None:
        self._values[digest] = value
        self._values.move_to_end(digest)
        if len(self._values) > self._max_num_keys:
            self._values.popitem(last=False)

    def predict(self, user: str | None, model: str) -> int:
        digest = _digest(user, model)
        value = self._values.get(digest)
        if value is None:
            if digest not in self._asked and len(self._to_fetch) < _MAX_FETCH:
                self._to_fetch[digest] = None
            return self._default
        return max(1, round(value))

    def observe(self, user: str | None, model: str, output_tokens: int) -> None:
        digest = _digest(user, model)
        old = self._values.get(digest)
        new = float(output_tokens) if old is None else old + self._alpha * (output_tokens - old)
        self._set(digest, new)
        self._pending.append((digest, output_tokens))

    # -- the Redis side -------------------------------------------------------------
    async def start(self) -> None:
        redis_asyncio = importlib.import_module("redis.asyncio")
        self._redis = redis_asyncio.Redis.from_url(
            self.redis_url, socket_timeout=2.0, socket_connect_timeout=1.0
        )
        self._tasks = [
            asyncio.ensure_future(self._flush_loop()),
            asyncio.ensure_future(self._receive_loop()),
        ]

    async def stop(self) -> None:
        await stop_tasks(self._tasks)  # bounded: a task may swallow its cancel
        self._tasks = []
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    def _up(self) -> None:
        if not self.is_shared:
            logger.info("output-length history shared through %s", self.redis_url)
        self.is_shared = True

    def _lost(self, exc: BaseException) -> None:
        if self.is_shared or self.num_failures == 0:
            logger.warning(
                "output-length history: Redis %s unreachable (%s): predicting from this "
                "gateway's own history", self.redis_url, type(exc).__name__,
            )  # fmt: skip
        self.is_shared = False
        self.num_failures += 1

    async def _flush(self) -> bool:
        """Send what is pending; False when there was nothing to send (Redis untouched)."""
        batch = list(self._pending)
        fetch = list(self._to_fetch)
        if not batch and not fetch:
            return False
        prefix, cfg = self.cfg.key_prefix, self.cfg
        async with self._redis.pipeline(transaction=False) as pipe:
            for digest, tokens in batch:
                args = (tokens, self._alpha, cfg.ttl_s, cfg.channel, digest)
                pipe.eval(_OBSERVE_LUA, 1, prefix + digest, *args)
            for digest in fetch:
                pipe.hget(prefix + digest, "ewma")
            results = await pipe.execute()
        for _ in batch:  # sent: only now off the queue (kept while Redis is down)
            self._pending.popleft()
        self.num_written += len(batch)
        for digest, value in zip(fetch, results[len(batch) :], strict=True):
            self._to_fetch.pop(digest, None)
            self._asked[digest] = None
            if len(self._asked) > self._max_num_keys:
                self._asked.popitem(last=False)
            if value is not None and digest not in self._values:
                self._set(digest, float(value))
        return True

    async def _flush_loop(self) -> None:
        while True:
            try:
                if await self._flush():  # an idle flush says nothing of Redis
                    self._up()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(exc)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.cfg.flush_interval_s)

    def _take(self, data: bytes) -> None:
        digest, _, value = data.decode("ascii", "replace").partition(" ")
        with contextlib.suppress(ValueError):
            self._set(digest, float(value))
            self.num_received += 1

    async def _receive_loop(self) -> None:
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.cfg.channel)
                self._up()
                while True:
                    got = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if got is not None and got.get("type") == "message":
                        self._take(got["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(exc)
                self._asked.clear()  # values may have changed meanwhile: fetch again
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


class OutputHistoryMetrics(Collector):
    """``kiloserve_gateway_output_history_shared`` and its counters."""

    def __init__(self, history: SharedOutputPredictor) -> None:
        self._h = history

    def collect(self) -> Iterator[Any]:
        h = self._h
        yield GaugeMetricFamily(
            "kiloserve_gateway_output_history_shared",
            "1 while the output-length history is shared through Redis; 0: this gateway's own",
            value=1.0 if h.is_shared else 0.0,
        )
        yield CounterMetricFamily(
            "kiloserve_gateway_output_history_writes",
            "observations written to the shared output-length history",
            value=float(h.num_written),
        )
        yield CounterMetricFamily(
            "kiloserve_gateway_output_history_updates",
            "values received from the shared output-length history (all gateways')",
            value=float(h.num_received),
        )
        yield CounterMetricFamily(
            "kiloserve_gateway_output_history_failures",
            "Redis failures of the shared output-length history (each: own history only)",
            value=float(h.num_failures),
        )


class _Profiled(Protocol):
    outputs: OutputPredictor


def install_output_history(
    app: web.Application, cfg: GatewayConfig, profiler: _Profiled, registry: CollectorRegistry
) -> SharedOutputPredictor | None:
    """Share ``profiler``'s output-length history through Redis when a URL is known
    (``GatewayConfig.output_history_redis_url``): its metrics join ``registry`` and the
    app starts and stops its Redis tasks. None (the local history stays) without one."""
    url = cfg.output_history_redis_url()
    if url is None:
        return None
    history = SharedOutputPredictor(cfg.output_history, url, cfg.default_output_tokens)
    profiler.outputs = history
    registry.register(OutputHistoryMetrics(history))

    async def on_startup(_: web.Application) -> None:
        await history.start()

    async def on_cleanup(_: web.Application) -> None:
        await history.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return history
