"""``GET /v1/models`` through the gateway reuses the merged cards (gateway/model_cards.py
``ModelCardCache``): one fetch per backend per ``model_cards_ttl_s``, a new one at once
when the membership changes. Real servers on 127.0.0.1 that count the listings."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from test_gateway_fakes import (
    FakeBackend,
    fake_backends,
    gateway_config,
    running_gateway,
)
from test_gateway_reload import _reloading_gateway


@dataclass
class CountingFake(FakeBackend):
    """A fake whose ``/v1/models`` cards carry ``max_model_len`` and count the asks."""

    max_model_len: int = 1000
    num_lists: int = 0
    list_delay_s: float = 0.0

    async def _models(self, request: web.Request) -> web.Response:
        self.num_lists += 1
        await asyncio.sleep(self.list_delay_s)
        data = [{"id": m, "root": m, "max_model_len": self.max_model_len} for m in self.models]
        return web.json_response({"object": "list", "data": data})


def _backend(fake: FakeBackend, name: str) -> dict[str, Any]:
    # configured models: model discovery asks nothing, only the listings count
    return {"url": fake.url, "name": name, "models": fake.models}


async def _cards(gw: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as s, s.get(gw + "/v1/models") as r:
        assert r.status == 200
        return {c["id"]: c.get("max_model_len") for c in (await r.json())["data"]}


async def _settled(*fakes: CountingFake) -> list[int]:
    """The counts once the LoRA catalog's startup refresh (one ask each) is in (the
    tests turn the inventory's asks off: ``inventory_interval_s=0``)."""
    for _ in range(200):
        if all(f.num_lists >= 1 for f in fakes):
            break
        await asyncio.sleep(0.01)
    counts = [f.num_lists for f in fakes]
    await asyncio.sleep(0.1)
    assert [f.num_lists for f in fakes] == counts == [1] * len(fakes)  # no other asker
    return counts


async def test_listings_within_the_ttl_cost_one_fetch_per_backend() -> None:
    f1, f2 = CountingFake(models=["a"]), CountingFake(models=["b"], max_model_len=2000)
    async with fake_backends(f1, f2):
        cfg = gateway_config(
            [_backend(f1, "f1"), _backend(f2, "f2")],
            discovery_interval_s=60,
            inventory_interval_s=0,
        )
        async with running_gateway(cfg) as gw:  # model_cards_ttl_s: 5 s by default
            before = await _settled(f1, f2)
            listings = [await _cards(gw) for _ in range(10)]
            listings += await asyncio.gather(*(_cards(gw) for _ in range(10)))
            after = [f1.num_lists, f2.num_lists]
    assert listings == [{"a": 1000, "b": 2000}] * 20
    assert [n - m for n, m in zip(after, before, strict=True)] == [1, 1]


async def test_a_client_gone_mid_listing_leaves_the_shared_fetch_to_the_others() -> None:
    fake = CountingFake(models=["a"])
    async with fake_backends(fake):
        cfg = gateway_config([_backend(fake, "f")], discovery_interval_s=60, inventory_interval_s=0)
        async with running_gateway(cfg) as gw:
            (before,) = await _settled(fake)
            fake.list_delay_s = 0.3

            async def impatient() -> None:
                timeout = aiohttp.ClientTimeout(total=0.1)
                async with aiohttp.ClientSession(timeout=timeout) as s:
                    with contextlib.suppress(TimeoutError):
                        async with s.get(gw + "/v1/models") as r:
                            await r.read()

            async def patient() -> dict[str, int]:
                await asyncio.sleep(0.05)  # after the impatient one started the fetch
                return await _cards(gw)

            _, cards = await asyncio.gather(impatient(), patient())
            assert cards == {"a": 1000}
            assert await _cards(gw) == {"a": 1000}  # cached: the fetch outlived the client
            assert fake.num_lists - before == 1


async def test_cards_are_fetched_again_after_the_ttl() -> None:
    fake = CountingFake(models=["a"])
    async with fake_backends(fake):
        cfg = gateway_config(
            [_backend(fake, "f")],
            discovery_interval_s=60,
            inventory_interval_s=0,
            model_cards_ttl_s=0.3,
        )
        async with running_gateway(cfg) as gw:
            (before,) = await _settled(fake)
            assert await _cards(gw) == {"a": 1000}
            fake.max_model_len = 4000
            assert await _cards(gw) == {"a": 1000}  # within the TTL: cached
            await asyncio.sleep(0.35)
            assert await _cards(gw) == {"a": 4000}
            assert fake.num_lists - before == 2


async def test_a_zero_ttl_asks_live_every_time() -> None:
    fake = CountingFake(models=["a"])
    async with fake_backends(fake):
        cfg = gateway_config(
            [_backend(fake, "f")],
            discovery_interval_s=60,
            inventory_interval_s=0,
            model_cards_ttl_s=0,
        )
        async with running_gateway(cfg) as gw:
            (before,) = await _settled(fake)
            for _ in range(3):
                await _cards(gw)
            assert fake.num_lists - before == 3


async def test_a_backend_added_or_removed_shows_at_once(tmp_path: Path) -> None:
    f1, f2 = CountingFake(models=["a"]), CountingFake(models=["b"])
    path = tmp_path / "gateway.yaml"

    def write(*backends: dict[str, Any]) -> None:
        cfg = gateway_config(
            list(backends), discovery_interval_s=60, inventory_interval_s=0, model_cards_ttl_s=60
        )
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))

    async def reload(gw: str) -> None:
        async with aiohttp.ClientSession() as s, s.post(gw + "/admin/reload") as r:
            assert r.status == 200, await r.text()

    async with fake_backends(f1, f2):
        write(_backend(f1, "f1"))
        async with _reloading_gateway(path) as gw:
            assert await _cards(gw) == {"a": 1000}
            write(_backend(f1, "f1"), _backend(f2, "f2"))
            await reload(gw)
            assert await _cards(gw) == {"a": 1000, "b": 1000}  # within the TTL
            write(_backend(f2, "f2"))
            await reload(gw)
            assert await _cards(gw) == {"b": 1000}
