"""Idempotent state moves on a real etcd (issue 17, S3.5): two agents race on one key.

Each "agent" is its own ``EtcdClient`` (its own HTTP session) on the same etcd; moves
are the registry's (``gateway/registry/moves.py``): a transaction on the key's
``mod_revision``. Also the agent's own record writes (``Agent``) as moves, and a gateway
following the prefix through a drain made by a move.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from etcd_fixture import EtcdProcess
from test_gateway_fakes import admin_backends, gateway_config, running_gateway

from kiloserve.agent.loop import Agent, AgentConfig
from kiloserve.errors import ConflictError
from kiloserve.gateway.config import BackendConfig
from kiloserve.gateway.registry.etcd import EtcdClient
from kiloserve.gateway.registry.moves import (
    MAX_REMEMBERED_MOVES,
    move_record,
    new_move_id,
    set_draining,
    set_weight,
)
from kiloserve.gateway.registry.record import RegistryRecord, decode_record
from kiloserve.gateway.registry.settings import DEFAULT_PREFIX

KEY = DEFAULT_PREFIX + "b0"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path / "etcd-data")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.asynccontextmanager
async def _clients(etcd: EtcdProcess, n: int) -> AsyncIterator[list[EtcdClient]]:
    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(aiohttp.ClientSession()) for _ in range(n)]
        yield [EtcdClient([etcd.endpoint], s) for s in sessions]


def _record(weight: float = 1.0) -> RegistryRecord:
    backend = BackendConfig(url="http://127.0.0.1:9", name="b0", models=["m"], weight=weight)
    return RegistryRecord(backend)


async def _register(client: EtcdClient) -> int:
    result = await move_record(client, KEY, lambda _: _record(), move_id=new_move_id())
    assert result.applied
    return result.version


async def test_two_agents_racing_on_one_version_one_wins(etcd: EtcdProcess) -> None:
    async with _clients(etcd, 2) as (one, two):
        version = await _register(one)
        ids = [new_move_id(), new_move_id()]
        outcomes = await asyncio.gather(
            set_draining(one, KEY, True, move_id=ids[0], expected_version=version),
            set_weight(two, KEY, 0.25, move_id=ids[1], expected_version=version),
            return_exceptions=True,
        )
        won = [o for o in outcomes if not isinstance(o, BaseException)]
        lost = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(won) == 1 and won[0].applied and won[0].version > version
        assert len(lost) == 1 and isinstance(lost[0], ConflictError)
        assert f"expected version {version}" in str(lost[0])
        winner = ids[0] if not isinstance(outcomes[0], BaseException) else ids[1]
        now, raw = await two.get_one(KEY)
        assert now == won[0].version and raw is not None
        record = decode_record(raw, KEY)
        assert record.move_ids[-1] == winner
        # exactly one of the two changes landed
        assert record.is_draining != (record.backend.weight == 0.25)
        # the winner retried (same id, same stale version): a no-op, not a conflict
        again = await set_draining(one, KEY, True, move_id=winner, expected_version=version)
        again_w = await set_weight(two, KEY, 0.25, move_id=winner, expected_version=version)
        assert not again.applied and not again_w.applied
        assert (await one.get_one(KEY))[0] == now  # nothing written


async def test_moves_without_a_version_never_lose_a_write(etcd: EtcdProcess) -> None:
    """Two agents each make 10 weight moves at once: all 20 land, one revision each."""
    async with _clients(etcd, 2) as clients:
        start = await _register(clients[0])

        async def agent(client: EtcdClient, base: float) -> list[str]:
            ids = []
            for i in range(10):
                move_id = new_move_id()
                result = await set_weight(
                    client, KEY, base + i, move_id=move_id, expected_version=None
                )
                assert result.applied
                ids.append(move_id)
            return ids

        ids_a, ids_b = await asyncio.gather(agent(clients[0], 100.0), agent(clients[1], 200.0))
        version, raw = await clients[0].get_one(KEY)
        assert raw is not None
        assert version - start == 20  # 20 writes, none lost, none applied twice
        remembered = decode_record(raw, KEY).move_ids
        assert len(remembered) == MAX_REMEMBERED_MOVES
        assert set(remembered) <= set(ids_a) | set(ids_b)


async def test_a_drained_record_keeps_its_lease_and_reaches_the_gateway(
    etcd: EtcdProcess,
) -> None:
    """The agent registers (its writes are moves on its lease); an operator's drain
    move keeps that lease, and the gateway following the prefix stops routing there."""
    cfg = AgentConfig(
        engine_url="http://127.0.0.1:9", etcd=[etcd.endpoint], name="b0", models=["m"],
        ttl_s=2, interval_s=0.3, is_nvml_enabled=False,
    )  # fmt: skip
    registry = {"kind": "etcd", "etcd": [etcd.endpoint], "retry_interval_s": 0.2}
    gw_cfg = gateway_config([], registry=registry, health={"enabled": False})
    async with aiohttp.ClientSession() as session, running_gateway(gw_cfg, False) as gw:
        agent = Agent(cfg, session)
        agent.lease_id = await agent._etcd.lease_grant(cfg.ttl_s)
        await agent._write(await agent._record())
        assert agent.num_moves == 1
        client = EtcdClient([etcd.endpoint], session)
        version, _ = await client.get_one(KEY)
        result = await set_draining(
            client, KEY, True, move_id=new_move_id(), expected_version=version
        )
        assert result.applied
        for _ in range(100):
            rows = await admin_backends(gw)
            if rows.get("b0", {}).get("draining"):
                break
            await asyncio.sleep(0.05)
        assert rows["b0"]["draining"] and not rows["b0"]["routable"]
        await agent.release()  # revoking the lease deletes the drained key: it kept the lease
        assert (await client.get_one(KEY)) == (0, None)
