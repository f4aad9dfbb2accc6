"""``kiloserve gateway --workers 2``: two processes on one port, one exact in-flight view.

Real processes and sockets: the supervisor, two workers bound with SO_REUSEPORT, two
fake backends that hold every request. Every request and every admin read uses a
fresh connection, so the kernel spreads them over both workers; without the shared
view a worker reports (and routes on) only its own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends, gateway_process

from kiloserve.cpus import usable_cpus
from kiloserve.routing.engine_metrics import parse_samples
from worker_urls import children as _children

pytestmark = pytest.mark.slow


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("psm_*")}


@contextlib.asynccontextmanager
async def _gateway(
    *urls: str, config: Path | None = None
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    args = [a for u in urls for a in ("--backend", u)]
    if config is not None:
        args += ["-c", str(config)]
    async with gateway_process(*args, "--workers", "2") as (line, proc):
        assert line.startswith("kiloserve gateway listening on http://"), line
        yield line.split(" listening on ", 1)[1].split()[0], proc


async def _get(url: str) -> tuple[int, object]:
    connector = aiohttp.TCPConnector(force_close=True)  # a fresh connection each time
    async with aiohttp.ClientSession(connector=connector) as s, s.get(url) as r:
        return r.status, (await r.json() if r.status == 200 else None)


async def _in_flight(url: str) -> dict[str, int]:
    status, body = await _get(url + "/admin/backends")
    assert status == 200
    assert isinstance(body, dict)
    return {row["name"]: row["in_flight"] for row in body["backends"]}


async def _until(check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert callable(check)
        if await check():
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _hold(url: str, n: int, fakes: list[FakeBackend]) -> list[asyncio.Task[None]]:
    """``n`` requests, one at a time (each is at a backend before the next is sent)."""

    async def one() -> None:
        body = {"model": "m", "prompt": "x"}
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body):
            pass

    tasks: list[asyncio.Task[None]] = []
    for _ in range(n):
        before = sum(f.num_active for f in fakes)
        tasks.append(asyncio.ensure_future(one()))

        async def arrived(before: int = before) -> bool:
            return sum(f.num_active for f in fakes) > before

        await _until(arrived)
    return tasks


async def test_two_workers_route_and_count_as_one() -> None:
    shm_before = _shm()
    fakes = [FakeBackend(mode="hang"), FakeBackend(mode="hang")]
    async with fake_backends(*fakes), _gateway(*(f.url for f in fakes)) as (url, proc):

        async def ready() -> bool:
            return all([(await _get(url + "/ready"))[0] == 200 for _ in range(6)])

        await _until(ready)
        tasks = await _hold(url, 12, fakes)
        # least_request on the shared view alternates: 6 and 6 (each worker alone
        # would balance only its own share)
        assert [f.num_active for f in fakes] == [6, 6]
        for _ in range(8):  # fresh connections: both workers answer some of these
            assert sorted((await _in_flight(url)).values()) == [6, 6]

        # a worker dies with requests in flight: its replacement retires them
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)

        async def replaced() -> bool:
            kids = _children(proc.pid)
            return len(kids) == 2 and workers[0] not in kids

        await _until(replaced)

        async def exact() -> bool:
            held = sum(f.num_active for f in fakes)
            got = [sum((await _in_flight(url)).values()) for _ in range(6)]
            return all(g == held for g in got) and 0 < held < 12

        await _until(exact)

        for t in tasks:  # the clients go away: every count returns to zero
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        async def drained() -> bool:
            got = [sum((await _in_flight(url)).values()) for _ in range(6)]
            return got == [0] * 6 and sum(f.num_active for f in fakes) == 0

        await _until(drained)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert _shm() <= shm_before  # the segment is gone


async def test_a_drain_sent_to_one_worker_holds_on_all() -> None:
    fakes = [FakeBackend(), FakeBackend()]
    async with fake_backends(*fakes), _gateway(*(f.url for f in fakes)) as (url, _):

        async def ready() -> bool:
            return all([(await _get(url + "/ready"))[0] == 200 for _ in range(6)])

        await _until(ready)
        drain = url + f"/admin/backends/{fakes[1].url}/drain"
        async with aiohttp.ClientSession() as s, s.post(drain) as r:
            assert r.status == 200, await r.text()
        for _ in range(10):  # fresh connections: both workers serve some of these
            connector = aiohttp.TCPConnector(force_close=True)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post(url + "/v1/completions", json={"model": "m"}) as r,
            ):
                assert r.status == 200
                assert r.headers["x-kiloserve-backend"] == fakes[0].url
        # /metrics reaches one worker and answers for the gateway: counters summed,
        # gauges of the shared view once, other gauges one series per worker
        for _ in range(4):
            connector = aiohttp.TCPConnector(force_close=True)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.get(url + "/metrics") as r,
            ):
                text = await r.text()
            samples = list(parse_samples(text))
            served = sum(
                v for n, labels, v in samples
                if n == "kiloserve_gateway_requests_total" and labels.get("backend") == fakes[0].url
            )  # fmt: skip
            assert served == 10
            # in-flight counts are the shared view: once, as the answering worker holds
            # them (one per worker summed to twice the gateway's); other gauges per worker
            workers = {labels.get("worker") for n, labels, _ in samples
                       if n == "kiloserve_gateway_in_flight"}  # fmt: skip
            assert workers == {None}, text
            assert {labels.get("worker") for _, labels, _ in samples} >= {"0", "1"}, text


async def test_admission_is_one_budget_across_workers(tmp_path: Path) -> None:
    """``max_in_flight_per_backend: 2`` holds for the gateway, not for each worker."""
    conf = tmp_path / "gw.yaml"
    conf.write_text("admission: {enabled: true, capacity: {max_in_flight_per_backend: 2}}\n")
    fake = FakeBackend(mode="hang")
    async with fake_backends(fake), _gateway(fake.url, config=conf) as (url, _):

        async def ready() -> bool:
            return all([(await _get(url + "/ready"))[0] == 200 for _ in range(6)])

        await _until(ready)

        async def one() -> None:
            connector = aiohttp.TCPConnector(force_close=True)
            body = {"model": "m", "prompt": "x"}
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post(url + "/v1/completions", json=body),
            ):
                pass

        tasks = []
        for _ in range(8):  # fresh connections: both workers get some
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        assert fake.num_active == 2  # the rest wait in the workers' queues
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_rate_limits_hold_for_the_gateway_not_per_worker(tmp_path: Path) -> None:
    """A key's ``max_requests_per_min: 6``: six requests pass in all, whichever worker
    each connection lands on (each worker alone would let six through)."""
    conf = tmp_path / "gw.yaml"
    digest = hashlib.sha256(b"sk-k").hexdigest()
    conf.write_text(
        f"auth: {{keys: [{{name: k, key_sha256: '{digest}', max_requests_per_min: 6}}]}}\n"
    )
    fake = FakeBackend()
    async with fake_backends(fake), _gateway(fake.url, config=conf) as (url, _):

        async def ready() -> bool:
            return all([(await _get(url + "/ready"))[0] == 200 for _ in range(6)])

        await _until(ready)
        statuses = []
        for _ in range(12):  # fresh connections: both workers serve some
            connector = aiohttp.TCPConnector(force_close=True)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post(
                    url + "/v1/completions",
                    json={"model": "m", "max_tokens": 1},
                    headers={"Authorization": "Bearer sk-k"},
                ) as r,
            ):
                statuses.append(r.status)
        assert sorted(statuses) == [200] * 6 + [429] * 6, statuses


async def test_the_engines_are_scraped_once_not_per_worker() -> None:
    fake = FakeBackend()
    async with fake_backends(fake), _gateway(fake.url) as (url, _):

        async def ready() -> bool:
            return all([(await _get(url + "/ready"))[0] == 200 for _ in range(6)])

        await _until(ready)
        before = fake.num_metrics
        await asyncio.sleep(3.0)
        scrapes = fake.num_metrics - before
        # one scraper at 5 per second (scrape_interval_s 0.2) is ~15; two would be ~30
        assert 8 <= scrapes <= 21, scrapes
        for _ in range(6):  # every worker has fresh engine figures all the same
            status, body = await _get(url + "/admin/backends")
            assert status == 200 and isinstance(body, dict)
            row = body["backends"][0]
            assert not row["scrape_stale"] and row["kv_usage"] is not None, row


async def test_workers_auto_starts_one_per_usable_cpu() -> None:
    """``--workers auto``: as many workers as CPUs this process (and so its child) may
    use (``kiloserve.cpus.usable_cpus``: the affinity capped by the cgroup's quota); one
    CPU: one process, no supervisor. The ready line is a single process's either way
    (scripts take the URL from its end; before, it ended "(2 workers)")."""
    expected = usable_cpus()
    fake = FakeBackend()
    async with (
        fake_backends(fake),
        gateway_process("--backend", fake.url, "--workers", "auto") as (line, proc),
    ):
        assert line.startswith("kiloserve gateway listening on http://"), line
        url = line.split()[-1]

        async def all_up() -> bool:
            children = len(_children(proc.pid))
            return (
                children == (expected if expected > 1 else 0)
                and (await _get(url + "/ready"))[0] == 200
            )

        await _until(all_up)


async def test_workers_stop_when_their_supervisor_is_killed() -> None:
    """A supervisor killed with SIGKILL (no chance to stop its workers) leaves no worker
    serving the port on its own: each notices its parent is gone and stops."""
    fake = FakeBackend()
    async with fake_backends(fake), _gateway(fake.url) as (url, proc):

        async def both_up() -> bool:
            return len(_children(proc.pid)) == 2 and (await _get(url + "/ready"))[0] == 200

        await _until(both_up)
        workers = _children(proc.pid)
        proc.kill()
        await proc.wait()

        def alive(pid: int) -> bool:  # a zombie (exited, not yet reaped by init) is gone
            with contextlib.suppress(OSError):
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            return False

        async def gone() -> bool:
            return not any(alive(w) for w in workers)

        await _until(gone, timeout_s=15.0)
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError):  # nobody listens on the port any more
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
