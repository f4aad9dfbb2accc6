"""Per-key rate limits: token buckets for requests/min and tokens/min.

At admission a request takes 1 from its key's request bucket and its reserved tokens
(input estimate + ``max_tokens``, or the predicted output) from the token bucket; at
completion ``reconcile`` gives back what it reserved but did not use (or takes the
excess). A bucket holds at most one minute's worth and refills continuously.

Two stores with the same interface:

* ``LocalLimiter``: in-process buckets, time passed in (tests use a fake clock);
* ``RedisLimiter``: buckets in Redis, updated atomically by a Lua script that reads
  Redis's own clock, so every gateway replica sharing the Redis shares the limits.
  The ``redis`` package is imported only when a Redis URL is configured.
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

__all__ = [
    "LocalLimiter",
    "Quota",
    "RateLimitConfig",
    "RateLimiter",
    "RedisLimiter",
    "SharedLimiter",
    "TokenBucket",
    "create_limiter",
]


class RateLimitConfig(BaseModel):
    """The ``rate_limit`` config section: where buckets live."""

    model_config = ConfigDict(extra="forbid")

    redis_url: str | None = None
    key_prefix: str = "kiloserve:rl:"


@dataclass(frozen=True, slots=True)
class Quota:
    """A key's limits per minute (None: unlimited)."""

    name: str
    max_requests_per_min: float | None
    max_tokens_per_min: float | None


@dataclass(slots=True)
class TokenBucket:
    """A token bucket: ``capacity`` at most, refilled at ``rate_per_s``; time passed in."""

    capacity: float
    rate_per_s: float
    level: float
    updated_s: float

    @classmethod
    def per_minute(cls, limit: float, now_s: float) -> TokenBucket:
        return cls(capacity=limit, rate_per_s=limit / 60.0, level=limit, updated_s=now_s)

    def refill(self, now_s: float) -> None:
        elapsed_s = max(0.0, now_s - self.updated_s)
        self.level = min(self.capacity, self.level + elapsed_s * self.rate_per_s)
        self.updated_s = max(self.updated_s, now_s)

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` is available (after refill); 0 if it is now."""
        short = min(amount, self.capacity) - self.level
        return 0.0 if short <= 0 else short / self.rate_per_s

    def adjust(self, delta: float) -> None:
        """Give back (delta > 0) or take more (delta < 0); may go negative (debt)."""
        self.level = min(self.capacity, self.level + delta)


class RateLimiter(Protocol):
    """``acquire`` returns 0.0 when granted, else the seconds to wait (Retry-After)."""

    async def acquire(self, quota: Quota, tokens: int, now_s: float) -> float: ...

    async def reconcile(self, quota: Quota, delta_tokens: int, now_s: float) -> None: ...

    async def close(self) -> None: ...


class LocalLimiter:
    """In-process buckets keyed by key name."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, name: str, kind: str, limit: float, now_s: float) -> TokenBucket:
        b = self._buckets.get((name, kind))
        if b is None or b.capacity != limit:
            b = TokenBucket.per_minute(limit, now_s)
            self._buckets[(name, kind)] = b
        b.refill(now_s)
        return b

    def _buckets_for(self, quota: Quota, now_s: float) -> list[tuple[TokenBucket, float]]:
        out: list[tuple[TokenBucket, float]] = []
        if quota.max_requests_per_min is not None:
            out.append((self._bucket(quota.name, "req", quota.max_requests_per_min, now_s), 1))
        if quota.max_tokens_per_min is not None:
            out.append((self._bucket(quota.name, "tok", quota.max_tokens_per_min, now_s), 0))
        return out

    async def acquire(self, quota: Quota, tokens: int, now_s: float) -> float:
        return self.acquire_now(quota, tokens, now_s)

    def acquire_now(self, quota: Quota, tokens: int, now_s: float) -> float:
        """Synchronous ``acquire`` (all buckets or none)."""
        buckets = self._buckets_for(quota, now_s)
        pairs = [(b, 1.0 if is_req else float(tokens)) for b, is_req in buckets]
        wait = max((b.wait_s(amount) for b, amount in pairs), default=0.0)
        if wait > 0.0:
            return wait
        for b, amount in pairs:
            b.adjust(-amount)
        return 0.0

    async def reconcile(self, quota: Quota, delta_tokens: int, now_s: float) -> None:
        if quota.max_tokens_per_min is None or delta_tokens == 0:
            return
        self._bucket(quota.name, "tok", quota.max_tokens_per_min, now_s).adjust(delta_tokens)

    async def close(self) -> None:
        return None


# KEYS: bucket keys; ARGV: triples (capacity, rate_per_s, amount) per key, then force,
# then ttl_s. All or nothing: returns 0 when every bucket had its amount (and takes it),
# else the longest wait in milliseconds (and takes nothing). force=1 always applies the
# amounts (reconciliation: a negative amount gives back, a positive one may go into debt).
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[#ARGV])
local force = tonumber(ARGV[#ARGV-1])
local levels = {}
local wait = 0
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[3*i-2]); local rate = tonumber(ARGV[3*i-1])
  local amount = tonumber(ARGV[3*i])
  local st = redis.call('HMGET', key, 'level', 'ts')
  local level = tonumber(st[1]) or cap
  local ts = tonumber(st[2]) or now
  level = math.min(cap, level + math.max(0, now - ts) * rate)
  levels[i] = level
  if amount > 0 then
    local short = math.min(amount, cap) - level
    if short > 0 then wait = math.max(wait, short / rate) end
  end
end
if wait > 0 and force == 0 then return math.ceil(wait * 1000) end
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[3*i-2])
  local level = math.min(cap, levels[i] - tonumber(ARGV[3*i]))
  redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(now))
  redis.call('EXPIRE', key, ttl)
end
return 0
"""


REDIS_TIMEOUT_S = 2.0  # one Redis call (connect, or send and answer) of the limiter


class RedisLimiter:
    """Buckets in Redis, shared by every gateway using the same ``redis_url``."""

    def __init__(self, redis_url: str, key_prefix: str = "kiloserve:rl:") -> None:
        import redis.asyncio as aioredis  # optional dependency: only when configured

        # bounded: a Redis that stops answering fails open after this, not never
        self._client: Any = aioredis.Redis.from_url(
            redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        self._script: Any = self._client.register_script(_ACQUIRE_LUA)
        self._prefix = key_prefix

    def _key(self, name: str, kind: str) -> str:
        return f"{self._prefix}{kind}:{hashed_name(name)}"

    async def _run(self, parts: list[tuple[str, float, float]], force: bool = False) -> float:
        if not parts:
            return 0.0
        keys = [k for k, _, _ in parts]
        args: list[float] = []
        for _, limit, amount in parts:
            args += [limit, limit / 60.0, amount]
        waited_ms = await self._script(keys=keys, args=[*args, int(force), 120])
        return int(waited_ms) / 1000.0

    async def acquire(self, quota: Quota, tokens: int, now_s: float) -> float:
        parts: list[tuple[str, float, float]] = []
        if quota.max_requests_per_min is not None:
            parts.append((self._key(quota.name, "req"), quota.max_requests_per_min, 1.0))
        if quota.max_tokens_per_min is not None:
            parts.append((self._key(quota.name, "tok"), quota.max_tokens_per_min, float(tokens)))
        return await self._run(parts)

    async def reconcile(self, quota: Quota, delta_tokens: int, now_s: float) -> None:
        if quota.max_tokens_per_min is None or delta_tokens == 0:
            return
        key = self._key(quota.name, "tok")
        await self._run([(key, quota.max_tokens_per_min, float(-delta_tokens))], force=True)

    async def close(self) -> None:
        await self._client.aclose()


def hashed_name(name: str) -> str:
    """Key names in Redis are hashed too (no tenant names in a shared store)."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


class BucketStore(Protocol):
    """Buckets shared by processes (``routing.shared_load.SharedLoad.buckets``)."""

    def buckets(self) -> AbstractContextManager[dict[str, list[float]]]: ...


class SharedLimiter(LocalLimiter):
    """``LocalLimiter``'s buckets kept in a store the gateway's workers share
    (``--workers N``): each acquire loads the key's buckets, decides as the local
    limiter does and writes them back, under the store's lock, so a key's limits hold
    for the whole gateway whichever worker its connections land on."""

    def __init__(self, store: BucketStore) -> None:
        super().__init__()
        self._store = store

    def _load(self, stored: dict[str, list[float]]) -> None:
        self._buckets.clear()
        for key, (level, updated_s, capacity) in stored.items():
            name, kind = key.rsplit("\0", 1)
            self._buckets[(name, kind)] = TokenBucket(capacity, capacity / 60.0, level, updated_s)

    def _save(self, stored: dict[str, list[float]]) -> None:
        for (name, kind), b in self._buckets.items():
            stored[f"{name}\0{kind}"] = [b.level, b.updated_s, b.capacity]

    def acquire_now(self, quota: Quota, tokens: int, now_s: float) -> float:
        with self._store.buckets() as stored:
            self._load(stored)
            wait = super().acquire_now(quota, tokens, now_s)
            self._save(stored)
        return wait

    async def reconcile(self, quota: Quota, delta_tokens: int, now_s: float) -> None:
        with self._store.buckets() as stored:
            self._load(stored)
            await super().reconcile(quota, delta_tokens, now_s)
            self._save(stored)


def create_limiter(cfg: RateLimitConfig) -> RateLimiter:
    if cfg.redis_url:
        return RedisLimiter(cfg.redis_url, cfg.key_prefix)
    return LocalLimiter()
