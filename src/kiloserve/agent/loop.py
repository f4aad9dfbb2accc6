"""The agent loop: watch the engine's /health, hold an etcd lease while it is good.

Every ``interval_s``: GET the engine's ``/health``. While it answers 200 the agent keeps
a lease (``ttl_s``) alive and its record under ``prefix + name`` up to date (models,
node health from NVML or, with ``dcgm_url``, the node's dcgm-exporter; ``draining``
when the health score falls below ``min_health_score``). After ``max_num_failures``
failed checks in a row it revokes the lease, which deletes the key at once; a killed
agent's key goes when the lease runs out. On exit (SIGTERM / SIGINT) the lease is
revoked. An unreachable etcd is retried every interval; the record is re-put on a new
lease when the old one expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kiloserve.agent.dcgm import read_dcgm
from kiloserve.agent.nvml import health_score, read_nvml
from kiloserve.errors import ConflictError, EtcdError
from kiloserve.gateway.config import BackendConfig
from kiloserve.gateway.registry.etcd import EtcdClient
from kiloserve.gateway.registry.moves import move_record, new_move_id
from kiloserve.gateway.registry.record import RegistryRecord, decode_record, encode_record
from kiloserve.gateway.registry.settings import DEFAULT_PREFIX

__all__ = ["Agent", "AgentConfig"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AgentConfig:
    engine_url: str
    etcd: list[str]
    name: str
    models: list[str] = field(default_factory=list)
    prefix: str = DEFAULT_PREFIX
    ttl_s: int = 3
    interval_s: float = 1.0
    timeout_s: float = 1.0
    max_num_failures: int = 2
    min_health_score: float = 0.5
    gpu: str = ""
    weight: float = 1.0
    is_nvml_enabled: bool = True
    kv_events_endpoint: str | None = None  # the engine's KV-event publisher (docs/kv-events.md)
    kv_events_replay_endpoint: str | None = None
    dcgm_url: str | None = None  # node health from this dcgm-exporter page, not NVML


class Agent:
    """One engine's registration; ``run`` until ``stop`` is set."""

    def __init__(self, cfg: AgentConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.key = cfg.prefix + cfg.name
        self._session = session
        self._etcd = EtcdClient(cfg.etcd, session, cfg.timeout_s)
        self.lease_id = 0
        self._last_value = b""
        self._num_failures = 0
        self.num_moves = 0  # state moves (record writes) applied in etcd

    async def _engine_ok(self) -> bool:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self._session.get(self.cfg.engine_url + "/health") as resp:
                    await resp.read()
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _models(self) -> list[str]:
        if self.cfg.models:
            return self.cfg.models
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self._session.get(self.cfg.engine_url + "/v1/models") as resp:
                    data = orjson.loads(await resp.read())
            return [m["id"] for m in data["data"] if isinstance(m.get("id"), str)]
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError):
            return []

    async def _record(self) -> bytes:
        nvml = await self._node_health()
        score = health_score(nvml)
        backend = BackendConfig(
            url=self.cfg.engine_url, name=self.cfg.name, models=await self._models(),
            gpu=self.cfg.gpu, weight=self.cfg.weight,
            kv_events_endpoint=self.cfg.kv_events_endpoint,
            kv_events_replay_endpoint=self.cfg.kv_events_replay_endpoint,
            node_metrics_url=self.cfg.dcgm_url,
        )  # fmt: skip
        draining = score < self.cfg.min_health_score
        health = {"score": score, "nvml": nvml}
        return encode_record(RegistryRecord(backend, draining, health))

    async def _node_health(self) -> dict[str, Any] | None:
        """The node's GPUs from ``dcgm_url`` when set, else NVML (when enabled)."""
        if self.cfg.dcgm_url is not None:
            return await read_dcgm(self._session, self.cfg.dcgm_url, self.cfg.timeout_s)
        return await asyncio.to_thread(read_nvml) if self.cfg.is_nvml_enabled else None

    async def _hold(self) -> None:
        """Engine healthy: make sure the lease lives and the record is current."""
        if self.lease_id and await self._etcd.lease_keepalive(self.lease_id) <= 0:
            logger.warning("lease %x expired; registering again", self.lease_id)
            self.lease_id, self._last_value = 0, b""
        if not self.lease_id:
            self.lease_id = await self._etcd.lease_grant(self.cfg.ttl_s)
        value = await self._record()
        if value != self._last_value:
            await self._write(value)
            if not self._last_value:
                logger.info("registered %s at %s", self.cfg.engine_url, self.key)
            self._last_value = value

    async def _write(self, value: bytes) -> None:
        """Put the record as one state move (S3.5, ``registry/moves.py``): a
        transaction on the key's revision, so a write never lands on top of one it did
        not see; ``num_moves`` counts the applied ones."""
        record = decode_record(value, self.key)
        try:
            result = await move_record(
                self._etcd, self.key, lambda _current: record,
                move_id=new_move_id(), lease_id=self.lease_id,
            )  # fmt: skip
        except ConflictError as exc:  # another writer keeps winning: next interval
            raise EtcdError(str(exc)) from exc
        self.num_moves += result.applied

    async def release(self) -> None:
        """Revoke the lease (deletes the key); quiet when etcd is gone."""
        if not self.lease_id:
            return
        try:
            await self._etcd.lease_revoke(self.lease_id)
            logger.info("deregistered %s", self.key)
        except EtcdError as exc:
            logger.warning(
                "could not revoke the lease (%s); it expires in %d s", exc, self.cfg.ttl_s
            )
        self.lease_id, self._last_value = 0, b""

    async def step(self) -> None:
        if await self._engine_ok():
            self._num_failures = 0
            await self._hold()
            return
        self._num_failures += 1
        if self._num_failures >= self.cfg.max_num_failures and self.lease_id:
            logger.warning("engine %s failed %d health checks: deregistering",
                           self.cfg.engine_url, self._num_failures)  # fmt: skip
            await self.release()

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except EtcdError as exc:
                    logger.warning("etcd: %s (retrying)", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.cfg.interval_s)
        finally:
            await self.release()
