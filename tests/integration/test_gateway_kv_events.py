"""The gateway's KV-event subscriber end to end: a fake vLLM publisher (ZMQ on 127.0.0.1),
fake HTTP backends and a real gateway app.

The fake publisher is vLLM's ``ZmqEventPublisher`` in miniature: batches encoded with
``kvevents.wire.encode_batch`` go out as ``(topic, seq, payload)`` and into a buffer that
a ROUTER replay socket serves (``(b"", topic, seq, payload)`` per batch, then the end
marker). Its live socket is an XPUB (a PUB that also reports (un)subscriptions), so a
test knows when the gateway's SUB has joined or left instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_fakes import FakeBackend, fake_backends, gateway_config, wait_until_ready

from kiloserve.gateway.app import KV_EVENTS_KEY, TABLE_KEY, create_gateway_app
from kiloserve.gateway.profile import Profiler
from kiloserve.kvevents.feed import KvEventCache
from kiloserve.kvevents.wire import END_SEQ, BlockStored, EventBatch, encode_batch, encode_seq
from kiloserve.routing.config import BackendConfig
from kiloserve.tokens import prefix_block_hashes

BLOCK = 16
TOPIC = b"kv-events"
REPLAY_TIMEOUT_S = 0.3
# three prompt blocks: A -> B -> C (one chain), and D, the root of another prompt
TOKENS = {name: [i * 100 + t for t in range(BLOCK)] for i, name in enumerate("ABCD", 1)}


def stored(name: str, parent: str | None = None) -> BlockStored:
    """Block ``name`` stored by the engine (engine hash: its name)."""
    return BlockStored(
        block_hashes=(name.encode(),),
        parent_block_hash=None if parent is None else parent.encode(),
        token_ids=tuple(TOKENS[name]),
        block_size=BLOCK,
    )


def hashes(*names: str) -> tuple[int, ...]:
    """The gateway's prefix hashes of a prompt made of these blocks."""
    return tuple(prefix_block_hashes([t for n in names for t in TOKENS[n]], BLOCK))


class FakePublisher:
    """A KV-event publisher: XPUB live socket, optional ROUTER replay socket."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self.replay_starts: list[int] = []
        self.is_answering = True
        self.replay_endpoint: str | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            port = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
            self._task = asyncio.create_task(self._serve_replays())

    def backend(self, url: str, name: str = "b") -> dict[str, Any]:
        """The gateway YAML entry of a backend at ``url`` publishing here."""
        return {
            "url": url,
            "name": name,
            "models": ["m"],
            "kv_events_endpoint": self.endpoint,
            "kv_events_replay_endpoint": self.replay_endpoint,
        }

    async def publish(self, *events: Any, send: bool = True) -> int:
        """Buffer the next batch and (unless ``send`` is False: a lost batch) send it."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = encode_batch(EventBatch(time.time(), tuple(events)))
        self.buffer.append((seq, payload))
        if send:
            await self.send_raw([TOPIC, encode_seq(seq), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine restarted: numbering from 0 again, an empty buffer."""
        self.next_seq = 0
        self.buffer.clear()

    async def wait_for(self, frame: bytes, timeout_s: float = 3.0) -> None:
        """Until the XPUB reports a subscribe (``b"\\x01"``) or unsubscribe (``b"\\x00"``)."""
        async with asyncio.timeout(timeout_s):
            while await self.pub.recv() != frame:
                pass

    async def _serve_replays(self) -> None:
        assert self._router is not None
        while True:
            client, _empty, start_frame = await self._router.recv_multipart()
            start = int.from_bytes(start_frame, "big", signed=True)
            self.replay_starts.append(start)
            if not self.is_answering:
                continue
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._router.send_multipart(
                        [client, b"", TOPIC, encode_seq(seq), payload]
                    )
            await self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._router is not None:
            self._router.close(linger=0)
        self.pub.close(linger=0)


@contextlib.asynccontextmanager
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def publishers(
    ctx: zmq.asyncio.Context, *replays: bool
) -> AsyncIterator[list[FakePublisher]]:
    pubs = [FakePublisher(ctx, replay=r) for r in replays]
    try:
        yield pubs
    finally:
        for p in pubs:
            await p.close()


@contextlib.asynccontextmanager
async def kv_gateway(backends: list[dict[str, Any]]) -> AsyncIterator[tuple[str, web.Application]]:
    """A gateway on 127.0.0.1:0 with short KV-event timeouts: (base URL, app)."""
    cfg = gateway_config(backends, health={"enabled": False})
    app = create_gateway_app(cfg)
    app[KV_EVENTS_KEY].replay_timeout_s = REPLAY_TIMEOUT_S
    app[KV_EVENTS_KEY].poll_interval_s = 0.02
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        await wait_until_ready(url)
        yield url, app
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def one_backend(
    *, replay: bool
) -> AsyncIterator[tuple[FakePublisher, FakeBackend, str, web.Application]]:
    """One publisher, one fake HTTP backend ``b`` and a gateway subscribed to it."""
    async with (
        zmq_context() as ctx,
        publishers(ctx, replay) as (pub,),
        fake_backends(FakeBackend()) as (fake,),
        kv_gateway([pub.backend(fake.url)]) as (gw, app),
    ):
        yield pub, fake, gw, app


def cache_of(app: web.Application) -> KvEventCache:
    cache = app[TABLE_KEY].kv_cache
    assert cache is not None
    return cache


async def kv_rows(gw: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(gw + "/admin/config") as r:
        assert r.status == 200
        rows: dict[str, dict[str, Any]] = (await r.json())["kv_events"]
    return rows


async def metrics(gw: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(gw + "/metrics") as r:
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("kiloserve_kv_", "kiloserve_tokenizer_"))
    }


def kv_metric(values: dict[Any, float], name: str, **labels: str) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


async def until(check: Callable[[], Any], timeout_s: float = 3.0) -> None:
    """Poll ``check`` (sync or async) every 20 ms until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)


async def row_is(gw: str, backend: str, **want: Any) -> bool:
    row = (await kv_rows(gw)).get(backend)
    return row is not None and all(row[k] == v for k, v in want.items())


async def test_events_make_the_backend_exact_and_the_replay_rebuilds_what_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    modes = {"m": "exact", "other": "approximate"}
    monkeypatch.setattr(Profiler, "tokenizer_modes", lambda self: modes, raising=False)
    async with zmq_context() as ctx, publishers(ctx, True) as (pub,):
        await pub.publish(stored("A"))  # before the gateway: only the replay can bring it
        async with (
            fake_backends(FakeBackend()) as (fake,),
            kv_gateway([pub.backend(fake.url)]) as (gw, app),
        ):
            await until(lambda: row_is(gw, "b", mode="exact", blocks=1))
            assert pub.replay_starts == [0]
            await pub.wait_for(b"\x01")
            await pub.publish(stored("B", parent="A"))
            await until(lambda: row_is(gw, "b", blocks=2))
            assert cache_of(app).match_depths(hashes("A", "B", "C")) == {"b": 2}
            row = (await kv_rows(gw))["b"]
            assert row == {
                "mode": "exact", "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint, "subscribed": True,
                "batches": 2, "events": 2, "gaps": 0, "resyncs": 0, "restarts": 0,
                "blocks": 2, "bad_messages": 0,
            }  # fmt: skip
            async with aiohttp.ClientSession() as s, s.get(gw + "/admin/config") as r:
                config = await r.json()
            assert config["tokenizer_modes"] == modes
            assert config["backends"][0]["kv_events_endpoint"] == pub.endpoint  # kept
            assert "deployment" in config
            values = await metrics(gw)
            assert kv_metric(values, "kiloserve_kv_events_total", backend="b") == 2
            assert kv_metric(values, "kiloserve_kv_event_batches_total", backend="b") == 2
            assert kv_metric(values, "kiloserve_kv_event_gaps_total", backend="b") == 0
            assert kv_metric(values, "kiloserve_kv_index_blocks") == 2
            assert kv_metric(values, "kiloserve_kv_index_mode", backend="b", mode="exact") == 1
            assert (
                kv_metric(values, "kiloserve_kv_index_mode", backend="b", mode="approximate") == 0
            )
            assert kv_metric(values, "kiloserve_tokenizer_mode", model="m", mode="exact") == 1
            assert kv_metric(values, "kiloserve_tokenizer_mode", model="other", mode="exact") == 0


async def test_a_skipped_sequence_number_is_filled_by_the_replay() -> None:
    async with one_backend(replay=True) as (pub, _fake, gw, app):
        await pub.wait_for(b"\x01")
        await until(lambda: pub.replay_starts == [0])
        await pub.publish(stored("A"))
        await until(lambda: row_is(gw, "b", blocks=1))
        await pub.publish(stored("B", parent="A"), send=False)  # lost on the way
        await pub.publish(stored("C", parent="B"))
        # queued behind the gap while the replay (which brings it too) runs: a
        # duplicate, not a publisher restart
        await pub.publish(stored("D"))
        await until(lambda: row_is(gw, "b", blocks=4))
        assert pub.replay_starts == [0, 1]
        row = (await kv_rows(gw))["b"]
        assert (row["mode"], row["gaps"], row["resyncs"], row["restarts"], row["batches"]) == (
                "exact", 1, 0, 0, 4,
            )  # fmt: skip
        assert cache_of(app).match_depths(hashes("A", "B", "C")) == {"b": 3}
        assert cache_of(app).match_depths(hashes("D")) == {"b": 1}
        values = await metrics(gw)
        assert kv_metric(values, "kiloserve_kv_event_gaps_total", backend="b") == 1
        assert kv_metric(values, "kiloserve_kv_event_resyncs_total", backend="b") == 0


async def test_a_gap_without_replay_drops_the_entries_then_the_next_batch_is_exact() -> None:
    async with one_backend(replay=False) as (pub, _fake, gw, app):
        await pub.wait_for(b"\x01")
        await pub.publish(stored("A"))
        await until(lambda: row_is(gw, "b", mode="exact", blocks=1))
        cache = cache_of(app)
        changes: list[tuple[str, str]] = []
        mode_changed = cache.mode_changed

        def record(backend_id: str, mode: Any) -> None:
            changes.append((backend_id, mode))
            mode_changed(backend_id, mode)

        cache.mode_changed = record  # type: ignore[method-assign]
        await pub.publish(stored("B", parent="A"), send=False)
        await pub.publish(stored("D"))
        await until(lambda: row_is(gw, "b", resyncs=1))
        assert changes == [("b", "approximate"), ("b", "exact")]
        assert cache.match_depths(hashes("A")) == {}
        assert cache.match_depths(hashes("D")) == {"b": 1}
        row = (await kv_rows(gw))["b"]
        assert (row["mode"], row["gaps"], row["blocks"]) == ("exact", 1, 1)
        values = await metrics(gw)
        assert kv_metric(values, "kiloserve_kv_event_resyncs_total", backend="b") == 1


async def test_a_replay_that_never_answers_resyncs() -> None:
    async with zmq_context() as ctx, publishers(ctx, True) as (pub,):
        pub.is_answering = False
        async with (
            fake_backends(FakeBackend()) as (fake,),
            kv_gateway([pub.backend(fake.url)]) as (gw, app),
        ):
            await pub.wait_for(b"\x01")
            await until(lambda: pub.replay_starts == [0])
            await asyncio.sleep(REPLAY_TIMEOUT_S)  # the first replay times out
            await pub.publish(stored("A"))
            await until(lambda: row_is(gw, "b", mode="exact", blocks=1))
            await pub.publish(stored("B", parent="A"), send=False)
            await pub.publish(stored("D"))
            await until(lambda: row_is(gw, "b", resyncs=1), timeout_s=REPLAY_TIMEOUT_S + 2)
            assert pub.replay_starts == [0, 1]
            assert cache_of(app).match_depths(hashes("A")) == {}
            assert cache_of(app).match_depths(hashes("D")) == {"b": 1}


async def test_a_publisher_restart_drops_the_old_entries() -> None:
    async with one_backend(replay=True) as (pub, _fake, gw, app):
        await pub.wait_for(b"\x01")
        await until(lambda: pub.replay_starts == [0])
        await pub.publish(stored("A"))
        await pub.publish(stored("B", parent="A"))
        await until(lambda: row_is(gw, "b", blocks=2))
        pub.restart()
        await pub.publish(stored("D"))  # seq 0 again
        await until(lambda: row_is(gw, "b", restarts=1))
        row = (await kv_rows(gw))["b"]
        assert (row["mode"], row["blocks"], row["gaps"]) == ("exact", 1, 0)
        assert cache_of(app).match_depths(hashes("A", "B")) == {}
        assert cache_of(app).match_depths(hashes("D")) == {"b": 1}
        values = await metrics(gw)
        assert kv_metric(values, "kiloserve_kv_event_restarts_total", backend="b") == 1


async def test_an_unhealthy_backend_drops_its_entries_and_resubscribes_when_healthy() -> None:
    async with one_backend(replay=True) as (pub, fake, gw, app):
        await pub.wait_for(b"\x01")
        await until(lambda: pub.replay_starts == [0])
        await pub.publish(stored("A"))
        await until(lambda: row_is(gw, "b", mode="exact", blocks=1))
        fake.metrics_status = 500  # scrapes fail: unhealthy after max_scrape_failures
        await until(lambda: row_is(gw, "b", mode="approximate", blocks=0, subscribed=False))
        assert (await kv_rows(gw))["b"]["resyncs"] == 1
        await pub.wait_for(b"\x00")  # the SUB socket is closed
        assert cache_of(app).match_depths(hashes("A")) == {}
        assert not app[TABLE_KEY].state("b").healthy
        fake.metrics_status = 200
        await until(lambda: row_is(gw, "b", mode="exact", blocks=1, subscribed=True))
        assert pub.replay_starts == [0, 0]  # rebuilt from the publisher's buffer
        assert cache_of(app).match_depths(hashes("A")) == {"b": 1}


async def test_added_backends_are_subscribed_and_removed_ones_unsubscribed() -> None:
    async with (
        zmq_context() as ctx,
        publishers(ctx, False, False) as (pub1, pub2),
        fake_backends(FakeBackend(), FakeBackend()) as (fake1, fake2),
        kv_gateway([pub1.backend(fake1.url, "b1")]) as (gw, app),
    ):
        table = app[TABLE_KEY]
        await pub1.wait_for(b"\x01")
        await pub1.publish(stored("A"))
        await until(lambda: row_is(gw, "b1", blocks=1))
        table.add_backend(BackendConfig.model_validate(pub2.backend(fake2.url, "b2")))
        await pub2.wait_for(b"\x01")
        await pub2.publish(stored("A"))
        await until(lambda: row_is(gw, "b2", mode="exact", blocks=1))
        assert cache_of(app).match_depths(hashes("A")) == {"b1": 1, "b2": 1}
        table.remove_backend("b1")
        await pub1.wait_for(b"\x00")  # its subscription is gone
        await until(lambda: "b1" not in app[KV_EVENTS_KEY].describe())
        cache = cache_of(app)
        assert cache.match_depths(hashes("A")) == {"b2": 1}
        assert [f.backend_id for f in cache.feeds()] == ["b2"]
        assert set(await kv_rows(gw)) == {"b2"}
        values = await metrics(gw)
        assert kv_metric(values, "kiloserve_kv_events_total", backend="b1") is None
        assert kv_metric(values, "kiloserve_kv_events_total", backend="b2") == 1


async def test_garbage_messages_are_counted_and_not_fatal() -> None:
    async with one_backend(replay=False) as (pub, _fake, gw, _app):
        await pub.wait_for(b"\x01")
        await pub.send_raw([b"only one frame"])
        await pub.send_raw([TOPIC, b"\x00\x01", b"seq frame too short"])
        await pub.send_raw([TOPIC, encode_seq(0), b"\xc1 not msgpack"])
        await pub.send_raw([TOPIC, encode_seq(0), b"\x81\xa1a\x01"])  # {"a": 1}
        await pub.publish(stored("A"))
        await until(lambda: row_is(gw, "b", mode="exact", blocks=1))
        row = (await kv_rows(gw))["b"]
        assert (row["bad_messages"], row["batches"], row["subscribed"]) == (4, 1, True)
        values = await metrics(gw)
        assert kv_metric(values, "kiloserve_kv_event_bad_messages_total", backend="b") == 4


async def test_no_publishing_backend_leaves_routing_without_a_kv_cache() -> None:
    async with (
        fake_backends(FakeBackend()) as (fake,),
        kv_gateway([{"url": fake.url, "name": "b", "models": ["m"]}]) as (gw, app),
    ):
        await asyncio.sleep(0.1)  # a few polls of the table
        assert app[TABLE_KEY].kv_cache is None
        assert await kv_rows(gw) == {}
        values = await metrics(gw)
        assert kv_metric(values, "kiloserve_kv_index_mode", backend="b", mode="approximate") == 1
        assert kv_metric(values, "kiloserve_kv_index_blocks") == 0


async def test_a_failing_subscription_is_retried_later_and_harms_no_other_backend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    too_long = "ipc:///tmp/" + "x" * 200  # ZMQ refuses to connect: file name too long
    async with (
        zmq_context() as ctx,
        publishers(ctx, False) as (pub,),
        fake_backends(FakeBackend(), FakeBackend()) as (fake1, fake2),
        kv_gateway([
            pub.backend(fake1.url, "good"),
            {"url": fake2.url, "name": "bad", "models": ["m"], "kv_events_endpoint": too_long},
        ]) as (gw, _app),
    ):  # fmt: skip
        await pub.wait_for(b"\x01")
        await pub.publish(stored("A"))
        await until(lambda: row_is(gw, "good", mode="exact", blocks=1))
        await until(lambda: row_is(gw, "bad", subscribed=False))
        await asyncio.sleep(0.3)  # 15 polls of the table
        row = (await kv_rows(gw))["bad"]
        assert (row["mode"], row["subscribed"]) == ("approximate", False)
        failed = [r for r in caplog.records if "KV event subscription to ipc://" in r.getMessage()]
        assert len(failed) == 1  # retried after a second, not at every poll
