"""LoRA adapters across backends: route to the holders, load where missing (issue 18).

A request's ``model`` may name an adapter. Backends that hold it serve it under that
name in ``/v1/models`` (vLLM lists adapters with ``parent`` = the base model), so
model discovery already puts them in the adapter's pool and the policy ranks them as
for any model. This module adds what discovery cannot:

* **a catalog** of adapters: ``lora.adapters`` in the config (name -> path, base
  model) plus every adapter card seen on any backend's ``/v1/models`` (``root`` is its
  path, ``parent`` its base), refreshed every ``discovery_interval_s``; an adapter
  stays known after every holder dropped it;
* **load on a miss**: when no routable backend holds a known adapter, the policy
  picks the best backend of the base model's pool (its own ranking, as for a request
  of the base model) and the gateway calls its ``POST /v1/load_lora_adapter``
  (vLLM's, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), then routes there. Requests for
  the same adapter that arrive during the load wait for that one load;
* **a per-backend budget**: at most ``lora.max_adapters_per_backend`` adapters per
  backend; before a load past it, the least recently requested adapter there is
  unloaded (``POST /v1/unload_lora_adapter``). "Recently requested" is the time a
  request for the adapter last reached the gateway while the backend held it.

A failed load leaves the request to the usual 404 of an unserved model, and the
backend's adapters as they were.

With ``--workers N`` the workers share their loads and unloads and load an adapter
once between them (``shared``: gateway/lora_shared.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kiloserve.gateway.lora_placement import Adapter, LoraPlacement
from kiloserve.gateway.lora_settings import LoraConfig
from kiloserve.gateway.lora_shared import SharedLora
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

__all__ = ["LORA_KEY", "LoraManager", "install_lora", "parse_adapter_cards"]

logger = logging.getLogger(__name__)


def parse_adapter_cards(data: object) -> list[Adapter]:
    """The adapters of a ``/v1/models`` body: cards whose ``parent`` names a base."""
    cards = data.get("data") if isinstance(data, dict) else None
    found: list[Adapter] = []
    for card in cards if isinstance(cards, list) else []:
        if not isinstance(card, dict):
            continue
        name, root, parent = card.get("id"), card.get("root"), card.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and parent:
            found.append(Adapter(name, root if isinstance(root, str) else name, parent))
    return found


class LoraManager:
    """The adapter catalog, the per-backend LRU and the load / unload calls."""

    def __init__(
        self,
        cfg: LoraConfig,
        table: BackendTable,
        router: Router,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.table = table
        self.clock = clock
        self.placement = LoraPlacement(table, router, cfg.max_adapters_per_backend)
        self.catalog = self.placement.catalog
        for name, known in cfg.adapters.items():
            self.catalog[name] = Adapter(name, known.path, known.base_model)
        self.session: aiohttp.ClientSession | None = None
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._backend_locks: dict[str, asyncio.Lock] = {}
        self.shared: SharedLora | None = None  # the sibling workers' loads (--workers N)
        self.num_loads = 0
        self.num_unloads = 0

    async def ensure(self, model: str, request_id: str) -> None:
        """Make ``model`` servable when it is a known adapter no routable backend holds."""
        adapter = self.catalog.get(model)
        if adapter is None:
            return
        if self.shared is not None:
            self.shared.sync(self.placement)
        holders = self.placement.holders(model)
        if holders:
            now = self.clock()
            self.placement.touch(model, holders, now)
            if self.shared is not None:
                self.shared.touch(model, holders, now)
            return
        pending = self._loading.get(model)
        if pending is not None:
            await asyncio.shield(pending)
            return
        future = asyncio.get_running_loop().create_future()
        self._loading[model] = future
        try:
            await self._load_once(adapter, request_id)
        finally:
            del self._loading[model]
            future.set_result(None)

    async def _load_once(self, adapter: Adapter, request_id: str) -> None:
        """Load it, unless a sibling worker is loading it: then wait for that load."""
        shared = self.shared
        if shared is None:
            await self._load_somewhere(adapter, request_id)
            return

        def is_held() -> bool:
            shared.sync(self.placement)
            return bool(self.placement.holders(adapter.name))

        # a claim outlives a load's calls (an unload and a load) before a sibling takes over
        if not await shared.claim(adapter.name, 3 * self.cfg.load_timeout_s, is_held):
            return
        try:
            if not is_held():  # a sibling's load may have ended just before the claim
                await self._load_somewhere(adapter, request_id)
        finally:
            shared.release(adapter.name)

    async def _load_somewhere(self, adapter: Adapter, request_id: str) -> None:
        backend_id = self.placement.pick(adapter, request_id, self.clock())
        if backend_id is None:
            return
        lock = self._backend_locks.setdefault(backend_id, asyncio.Lock())
        async with lock:
            await self._make_room(backend_id)
            body = {"lora_name": adapter.name, "lora_path": adapter.path}
            status = await self._call(backend_id, "/v1/load_lora_adapter", body)
            if status not in (200, 400):  # 400: vLLM's "has already been loaded"
                logger.warning(
                    "request_id=%s backend=%s loading LoRA adapter %s failed (status %s)",
                    request_id, backend_id, adapter.name, status,
                )  # fmt: skip
                return
            self.num_loads += 1
            self.placement.set_held(backend_id, adapter.name, is_held=True, now_s=self.clock())
            if self.shared is not None:
                self.shared.record(backend_id, adapter.name, held=True)
            logger.info(
                "request_id=%s backend=%s loaded LoRA adapter %s",
                request_id, backend_id, adapter.name,
            )  # fmt: skip

    async def _make_room(self, backend_id: str) -> None:
        if self.shared is not None:  # the least recently requested over every worker
            self.shared.take_uses(self.placement, self.clock())
        for victim in self.placement.victims(backend_id):
            body = {"lora_name": victim}
            status = await self._call(backend_id, "/v1/unload_lora_adapter", body)
            logger.info(
                "backend=%s unloaded LoRA adapter %s (least recently requested; status %s)",
                backend_id, victim, status,
            )  # fmt: skip
            self.num_unloads += 1
            self.placement.set_held(backend_id, victim, is_held=False, now_s=self.clock())
            if self.shared is not None:
                self.shared.record(backend_id, victim, held=False)

    async def _call(self, backend_id: str, path: str, body: dict[str, Any]) -> int | None:
        """POST ``body``; the status, or ``None`` when the backend did not answer."""
        if self.session is None:
            return None
        url = self.table.url_of(backend_id) + path
        try:
            async with (
                asyncio.timeout(self.cfg.load_timeout_s),
                self.session.post(url, data=orjson.dumps(body)) as resp,
            ):
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            logger.warning("backend=%s %s failed: %s", backend_id, path, type(exc).__name__)
            return None

    async def refresh_catalog(self, timeout_s: float) -> None:
        """Learn the adapters every backend lists in ``/v1/models``, and which it holds
        (also for backends whose models are configured, which discovery skips)."""
        if self.session is None:
            return
        session = self.session

        async def one(backend_id: str) -> list[Adapter] | None:
            url = self.table.url_of(backend_id) + "/v1/models"
            try:
                async with asyncio.timeout(timeout_s), session.get(url) as resp:
                    return parse_adapter_cards(orjson.loads(await resp.read()))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                return None

        ids = self.table.backend_ids()
        found = await asyncio.gather(*(one(b) for b in ids))
        for backend_id, adapters in zip(ids, found, strict=True):
            if adapters is None or backend_id not in self.table.backend_ids():
                continue
            for adapter in adapters:
                self.catalog.setdefault(adapter.name, adapter)
            listed = {a.name for a in adapters}
            self.placement.sync_held(backend_id, listed, self.clock())


LORA_KEY = web.AppKey("kiloserve_gateway_lora", LoraManager)


def install_lora(
    app: web.Application, cfg: LoraConfig, table: BackendTable, router: Router,
    interval_s: float, timeout_s: float,
) -> None:  # fmt: skip
    """Keep a ``LoraManager`` at ``app[LORA_KEY]`` and its catalog fresh while ``app`` runs."""
    manager = LoraManager(cfg, table, router)
    app[LORA_KEY] = manager

    async def refresh_forever() -> None:
        while True:
            await manager.refresh_catalog(timeout_s)
            if manager.shared is not None:  # last requests that no later one flushed
                manager.shared.flush_uses(manager.clock())
            await asyncio.sleep(interval_s)

    async def run(_: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as session:
            manager.session = session
            task = asyncio.create_task(refresh_forever())
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            manager.session = None

    app.cleanup_ctx.append(run)
