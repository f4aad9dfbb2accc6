"""Gateway side of the etcd registry: follow a key prefix into the live backend table.

Loop: read every key under the prefix (a full resync: add / update what is there,
remove registry backends that are not), then watch from the next revision and apply
each put / delete as it comes. When etcd cannot be reached the table keeps the last
known set, ``kiloserve_gateway_registry_up`` drops to 0 and a warning is logged once
per outage; the loop retries every ``retry_interval_s`` and resyncs when etcd is back.
Backends from the static ``backends:`` list are never removed by the registry.

With several workers (``--workers N``) each worker follows etcd itself and also writes
the records it applied to the shared segment's registry view
(``SharedLoad.registry_doc``): compact (the backend and its drain flag, no health
readings), after each full read, at most every ``PUBLISH_S`` while events come (an
agent rewrites its record when its node health changes: hundreds a second across a
large fleet must not each cost a JSON round trip of the whole view), and at once when
etcd stops answering. A worker starts from that view (the records its siblings saw
last) before its first etcd read, so a worker that replaces a dead one while etcd is
down routes to the same backends as its siblings instead of none; its first
successful read replaces the view's records as a resync does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiloserve.errors import ConfigError, EtcdError
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.metrics import PREFIX, GatewayMetrics
from kiloserve.gateway.registry.etcd import EtcdClient, WatchEvent
from kiloserve.gateway.registry.record import RegistryRecord, decode_record, encode_record
from kiloserve.routing.shared_load import SharedLoad
from kiloserve.routing.table import BackendTable

__all__ = ["PUBLISH_S", "RegistryWatcher", "start_registry"]

PUBLISH_S = 1.0  # a worker writes changed records to the registry view at most this often

logger = logging.getLogger(__name__)


class RegistryWatcher:
    """Applies the etcd prefix to ``table``; ``is_up`` says whether etcd answers."""

    def __init__(
        self, cfg: GatewayConfig, table: BackendTable, shared: SharedLoad | None = None
    ) -> None:
        self.cfg = cfg.registry
        self.table = table
        self.shared = shared  # the workers' segment: its registry view (module docstring)
        self._static = {b.backend_id for b in cfg.backends}
        self._key_to_id: dict[str, str] = {}
        self._records: dict[str, str] = {}  # key -> the record applied, as the view holds it
        self._dirty = False  # _records changed since the last publish
        self._published_at = -PUBLISH_S
        self.is_up = False
        self.num_errors = 0
        self.num_updates = 0
        self.last_ok_s: float | None = None

    def _apply_put(self, key: str, raw: bytes) -> None:
        try:
            record = decode_record(raw, key)
        except ConfigError as exc:
            logger.warning("ignoring registry entry: %s", exc)
            return
        backend_id = record.backend.backend_id
        if backend_id in self._static:
            logger.warning("registry key %s names static backend %s; ignored", key, backend_id)
            return
        old = self._key_to_id.get(key)
        if old is not None and old != backend_id:
            self.table.remove_backend(old)
        self._key_to_id[key] = backend_id
        if self.shared is not None:  # one process keeps no view
            compact = encode_record(RegistryRecord(record.backend, record.is_draining)).decode()
            if self._records.get(key) != compact:
                self._records[key] = compact
                self._dirty = True
        self.table.add_backend(record.backend)
        state = self.table.state(backend_id)
        if state.draining != record.is_draining:
            self.table.set_draining(backend_id, record.is_draining)
        self.num_updates += 1

    def _apply_delete(self, key: str) -> None:
        if self._records.pop(key, None) is not None:
            self._dirty = True
        backend_id = self._key_to_id.pop(key, None)
        if backend_id is not None:
            self.table.remove_backend(backend_id)
            self.num_updates += 1

    def apply(self, event: WatchEvent) -> None:
        if event.value is None:
            self._apply_delete(event.key)
        else:
            self._apply_put(event.key, event.value)

    def resync(self, kvs: dict[str, bytes]) -> None:
        for key in list(self._key_to_id):
            if key not in kvs:
                self._apply_delete(key)
        for key, raw in kvs.items():
            self._apply_put(key, raw)

    def seed_from_siblings(self) -> int:
        """Apply the shared registry view (before the first etcd read); how many records
        it held (0 without workers or before any worker read etcd)."""
        if self.shared is None:
            return 0
        with self.shared.registry_doc() as view:
            kvs = {k: v.encode() for k, v in view.items() if isinstance(v, str)}
        if kvs:
            self.resync(kvs)
            logger.info("registry: %d backends from the sibling workers' view", len(kvs))
        return len(kvs)

    def publish(self, *, now: bool = False) -> None:
        """Write the records applied to the shared view (the siblings' start point) when
        they changed: at most every ``PUBLISH_S`` unless ``now``."""
        if self.shared is None or not self._dirty:
            return
        at = time.monotonic()
        if not now and at - self._published_at < PUBLISH_S:
            return
        with self.shared.registry_doc() as view:
            if view != self._records:
                view.clear()
                view.update(self._records)
        self._dirty, self._published_at = False, at

    def _mark(self, is_up: bool, why: str = "") -> None:
        if is_up and not self.is_up:
            logger.info("etcd registry reachable: %d backends", len(self._key_to_id))
        elif not is_up and self.is_up:
            logger.warning("etcd registry unreachable (%s): keeping the last known %d backends",
                           why, len(self._key_to_id))  # fmt: skip
        if not is_up:
            self.num_errors += 1
        else:
            self.last_ok_s = time.monotonic()
        self.is_up = is_up

    async def run(self, client: EtcdClient) -> None:
        prefix = self.cfg.prefix
        self.seed_from_siblings()
        while True:
            try:
                revision, kvs = await client.get_prefix(prefix)
                self.resync(kvs)
                self.publish(now=True)
                self._mark(True)
                async for event in client.watch_prefix(prefix, revision + 1):
                    self.apply(event)
                    self.publish()
                    self.last_ok_s = time.monotonic()
            except EtcdError as exc:
                self.publish(now=True)  # the changes held back: the view outlives etcd
                self._mark(False, str(exc))
            await asyncio.sleep(self.cfg.retry_interval_s)


class _RegistryCollector(Collector):
    def __init__(self, watcher: RegistryWatcher) -> None:
        self._w = watcher

    def collect(self) -> Iterator[Any]:
        w = self._w
        up = GaugeMetricFamily(PREFIX + "registry_up", "1 while the etcd registry answers")
        up.add_metric([], 1.0 if w.is_up else 0.0)
        errors = CounterMetricFamily(PREFIX + "registry_errors", "failed etcd registry calls")
        errors.add_metric([], w.num_errors)
        count = GaugeMetricFamily(PREFIX + "registry_backends", "backends known from etcd")
        count.add_metric([], len(w._key_to_id))
        yield from (up, errors, count)


def start_registry(
    cfg: GatewayConfig,
    table: BackendTable,
    metrics: GatewayMetrics,
    shared: SharedLoad | None = None,
) -> asyncio.Task[None] | None:
    """Start following etcd when ``registry.kind`` is ``etcd``; None for the static list.
    ``shared``: the workers' segment (``--workers N``), for its registry view."""
    if cfg.registry.kind != "etcd":
        return None
    if not cfg.registry.etcd:
        raise ConfigError("registry.kind is etcd but registry.etcd lists no endpoints")
    watcher = RegistryWatcher(cfg, table, shared)
    metrics.registry.register(_RegistryCollector(watcher))

    async def main() -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.registry.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await watcher.run(EtcdClient(cfg.registry.etcd, session, cfg.registry.timeout_s))

    logger.info("backends from etcd %s prefix %s", cfg.registry.etcd, cfg.registry.prefix)
    return asyncio.create_task(main())
