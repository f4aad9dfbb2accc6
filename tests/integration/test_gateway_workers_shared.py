"""``kiloserve gateway --workers 2``: what one worker learns, every worker uses.

Real processes: the supervisor, two workers on one port, a healthy and a failing fake
backend. Requests go to one worker at a time through its private loopback port (each
worker also serves the gateway there: gateway/worker_metrics.py). Worker A ejects the
failing backend after its own failed requests; worker B, which never sent it one,
holds it out too (``routing.shared_verdicts``). Before the sharing, B kept sending it
requests until it had met the same failures itself; failures met by both workers are
one run, as in one process. Likewise a prefix A placed on a
backend is found there by B (``routing.shared_prefixes``), and the speeds A learned
from its requests are B's too (``SharedLoad.publish_sample``), and a Responses API
follow-up through B finds the backend that answered A (``routing.shared_responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends
from test_gateway_twins import MODEL, twins
from test_gateway_workers import _get, _until

from kiloserve.gateway.headers import BACKEND_HEADER, CACHED_TOKENS_HEADER
from kiloserve.routing.engine_metrics import parse_samples
from kiloserve.tokens import filler_text
from worker_urls import children as _children
from worker_urls import listening_ports as _listening_ports

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def _workers(*args: str) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """``kiloserve gateway ARGS --workers 2 --port 0`` for the block: (URL, supervisor)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiloserve", "gateway", *args, "--workers", "2",
        "--port", "0", "--log-level", "WARNING", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("kiloserve gateway listening on http://"), line
        yield line.split(" listening on ", 1)[1].split()[0], proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 40)


async def _private_urls(url: str, supervisor: int) -> tuple[str, str]:
    """Each worker's private loopback URL (the gateway, served by that worker alone),
    once both answer ``/ready``."""
    shared_port = int(url.rsplit(":", 1)[1])
    workers = _children(supervisor)
    assert len(workers) == 2
    private = []
    for pid in workers:

        async def listening(pid: int = pid) -> bool:
            return bool(_listening_ports(pid) - {shared_port})

        await _until(listening)
        (port,) = _listening_ports(pid) - {shared_port}
        private.append(f"http://127.0.0.1:{port}")

    async def ready() -> bool:
        return all([(await _get(u + "/ready"))[0] == 200 for u in private])

    await _until(ready)
    return private[0], private[1]


async def _post(url: str) -> int:
    connector = aiohttp.TCPConnector(force_close=True)
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        await r.read()
        return r.status


async def _reasons(url: str, name: str) -> list[str] | None:
    """The worker's ``unhealthy_reasons`` of a backend (None while it is healthy)."""
    status, body = await _get(url + "/admin/backends")
    assert status == 200 and isinstance(body, dict)
    row = next(r for r in body["backends"] if r["name"] == name)
    return None if row["healthy"] else list(row["unhealthy_reasons"])


@contextlib.asynccontextmanager
async def _good_and_bad(
    tmp_path: Path, settings: str, order: tuple[str, str], *args: str
) -> AsyncIterator[tuple[str, str, FakeBackend, FakeBackend]]:
    """Two workers (``settings`` YAML, then ``args``) in front of a healthy fake backend
    ``good`` and one that answers 500, ``bad``, listed in ``order``: yields each
    worker's private URL and the two fakes."""
    conf = tmp_path / "gw.yaml"
    rows = "".join(f"  - {{name: {name}, url: {name.upper()}, models: [m]}}\n" for name in order)
    good, bad = FakeBackend(), FakeBackend(mode="500")
    async with fake_backends(good, bad):
        conf.write_text(
            settings + "backends:\n" + rows.replace("GOOD", good.url).replace("BAD", bad.url)
        )
        async with _workers("-c", str(conf), *args) as (url, proc):
            a, b = await _private_urls(url, proc.pid)
            yield a, b, good, bad


async def test_a_backend_one_worker_ejects_is_held_out_by_every_worker(tmp_path: Path) -> None:
    settings = (
        "health: {enabled: false}\n"
        "outlier: {consecutive_gateway_failures: 2, base_ejection_time_s: 120,"
        " max_ejection_percent: 100}\n"
    )
    # bad first: least_request sends it every request while in-flight counts tie
    order = ("bad", "good")
    async with _good_and_bad(tmp_path, settings, order, "--policy", "least_request") as (
        a, b, good, bad,
    ):  # fmt: skip
        # worker A meets the failures (its retries answer the client from "good")
        for _ in range(30):
            assert await _post(a) == 200
            if await _reasons(a, "bad") == ["ejected"]:
                break
        assert await _reasons(a, "bad") == ["ejected"], (len(bad.bodies), len(good.bodies))
        sent_to_bad = len(bad.bodies)

        async def held_out_by_b() -> bool:
            return await _reasons(b, "bad") == ["ejected (another worker)"]

        await _until(held_out_by_b, timeout_s=5.0)
        for _ in range(10):
            assert await _post(b) == 200
        assert len(bad.bodies) == sent_to_bad  # worker B sent it nothing
        assert len(good.bodies) >= 10


async def test_failures_spread_over_the_workers_eject_at_the_threshold(tmp_path: Path) -> None:
    """Three failures in a row, two met by worker A and one by worker B, eject the
    backend (threshold 3), as one process would: the run is counted over the workers
    (``SharedVerdicts.note_failure``). Before, A's run was 2 and B's 1: no ejection."""
    settings = (
        "health: {enabled: false}\n"
        "outlier: {consecutive_gateway_failures: 3, base_ejection_time_s: 120,"
        " max_ejection_percent: 100}\n"
    )
    order = ("bad", "good")  # least_request: bad first while in-flight counts tie
    async with _good_and_bad(tmp_path, settings, order, "--policy", "least_request") as (
        a, b, good, bad,
    ):  # fmt: skip
        for n, worker in enumerate((a, b, a), 1):
            assert await _post(worker) == 200  # the retry answers from "good"
            assert len(bad.bodies) == n  # each request's first attempt met "bad"
        assert await _reasons(a, "bad") == ["ejected"]

        async def held_out_by_b() -> bool:
            return await _reasons(b, "bad") == ["ejected (another worker)"]

        await _until(held_out_by_b, timeout_s=5.0)
        assert len(good.bodies) == 3


async def _complete(url: str, prompt: str) -> tuple[str, int]:
    """(the backend that answered, the prompt tokens the gateway found cached there)."""
    connector = aiohttp.TCPConnector(force_close=True)
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        await r.read()
        assert r.status == 200
        return r.headers[BACKEND_HEADER], int(r.headers[CACHED_TOKENS_HEADER])


async def test_a_prefix_one_worker_placed_is_followed_by_every_worker() -> None:
    """``prefix_affinity``: worker A sends a long prompt to a backend; worker B, which
    never saw it, finds the prefix cached there (before the sharing: nothing cached)."""
    fakes = [FakeBackend(), FakeBackend()]
    async with fake_backends(*fakes):
        args = [a for f in fakes for a in ("--backend", f.url)]
        async with _workers(*args, "--policy", "prefix_affinity") as (url, proc):
            a, b = await _private_urls(url, proc.pid)
            prompt = filler_text(2000, seed=3)
            backend, cached = await _complete(a, prompt)
            assert cached == 0
            for tail in range(5):
                got, cached = await _complete(b, f"{prompt} tail {tail}")
                assert (got, cached) == (backend, 2000 // 16 * 16)


async def _stream(url: str) -> None:
    connector = aiohttp.TCPConnector(force_close=True)
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/completions", json=body) as r,
    ):
        await r.read()
        assert r.status == 200


async def _speeds(url: str) -> dict[str, tuple[float | None, float | None]]:
    status, body = await _get(url + "/admin/backends")
    assert status == 200 and isinstance(body, dict)
    return {r["name"]: (r["ewma_ttft_ms"], r["ewma_tpot_ms"]) for r in body["backends"]}


async def test_the_speeds_one_worker_learns_are_every_workers() -> None:
    """Streamed requests through worker A only: worker B's learned TTFT and TPOT of the
    backend equal A's (before the sharing: B had learned nothing, None)."""
    fake = FakeBackend(chunk_delay_s=0.01)
    async with fake_backends(fake), _workers("--backend", fake.url) as (url, proc):
        a, b = await _private_urls(url, proc.pid)
        for _ in range(5):
            await _stream(a)
        learned = await _speeds(a)
        ((ttft_ms, tpot_ms),) = learned.values()
        assert ttft_ms is not None and tpot_ms is not None and tpot_ms > 5.0

        async def b_learned_it() -> bool:
            return await _speeds(b) == learned

        await _until(b_learned_it, timeout_s=5.0)


async def _arrived(fake: FakeBackend, n: int) -> bool:
    return len(fake.bodies) >= n


async def _own_metric(worker_url: str, metric: str) -> float:
    """A metric of that worker's own page (summed over its labels)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.get(worker_url + "/metrics", params={"local": "1"}) as r,
    ):
        text = await r.text()
    return sum(value for name, _labels, value in parse_samples(text) if name == metric)


async def _queued_at(worker_url: str, n: int) -> bool:
    """Whether ``n`` requests wait in that worker's own admission queues."""
    return await _own_metric(worker_url, "kiloserve_gateway_admission_queue_depth") == n


async def _deferrals(worker_url: str) -> float:
    return await _own_metric(worker_url, "kiloserve_gateway_admission_deferrals_total")


async def test_freed_room_goes_to_the_oldest_waiter_whichever_worker_holds_it(
    tmp_path: Path,
) -> None:
    """One slot (``max_in_flight_per_backend: 1``): r1 runs at worker A, r2 waits at
    worker B, then r3 at worker A. When r1 ends at A, the slot goes to B's r2 (before
    the sharing, A gave it to its own r3)."""
    conf = tmp_path / "gw.yaml"
    conf.write_text("admission: {enabled: true, capacity: {max_in_flight_per_backend: 1}}\n")
    fake = FakeBackend(num_chunks=3, chunk_delay_s=0.7)
    async with (
        fake_backends(fake),
        _workers("--backend", fake.url, "-c", str(conf)) as (url, proc),
    ):
        a, b = await _private_urls(url, proc.pid)

        async def stream(url: str, name: str) -> None:
            body = {"model": "m", "prompt": name, "max_tokens": 3, "stream": True}
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 200
                await r.read()

        r1 = asyncio.ensure_future(stream(a, "r1"))
        await _until(lambda: _arrived(fake, 1))
        r2 = asyncio.ensure_future(stream(b, "r2"))
        await _until(lambda: _queued_at(b, 1))
        r3 = asyncio.ensure_future(stream(a, "r3"))
        await _until(lambda: _queued_at(a, 1))
        await asyncio.wait_for(asyncio.gather(r1, r2, r3), 60)
        order = [body["prompt"] for body in fake.bodies]
        assert order == ["r1", "r2", "r3"], (order, await _deferrals(a), await _deferrals(b))


async def test_the_dashboard_answers_for_every_worker() -> None:
    """Three requests through worker A, two through worker B: whichever worker serves
    ``/dashboard/state``, it shows all five decisions (``?local=1``: its own)."""
    fakes = [FakeBackend(), FakeBackend()]
    async with fake_backends(*fakes):
        args = [a for f in fakes for a in ("--backend", f.url)]
        async with _workers(*args) as (url, proc):
            a, b = await _private_urls(url, proc.pid)
            for worker, n in ((a, 3), (b, 2)):
                for _ in range(n):
                    assert await _post(worker) == 200
            for worker in (url, a, b):
                status, doc = await _get(worker + "/dashboard/state")
                assert status == 200 and isinstance(doc, dict)
                assert doc["gateway"]["workers"] == 2
                decisions = doc["decisions"]
                assert decisions["num_buffered"] == 5
                assert sum(s["count"] for s in decisions["by_policy"]) == 5
            own = {}
            for worker in (a, b):
                status, doc = await _get(worker + "/dashboard/state?local=1")
                assert status == 200 and isinstance(doc, dict)
                own[worker] = doc["decisions"]["num_buffered"]
            assert own == {a: 3, b: 2}


async def test_worker_0_probes_for_every_worker(tmp_path: Path) -> None:
    """The backends get one worker's health probes, not one set per worker (worker 0
    probes while it lives, as it scrapes); a backend its probes find failing is held
    out by the other worker too. Before, every worker probed every backend."""
    interval_s, watch_s = 0.2, 3.0
    settings = f"health: {{interval_s: {interval_s}, jitter: 0, completion_probe: true}}\n"
    async with _good_and_bad(tmp_path, settings, ("good", "bad")) as (a, b, good, _):

        async def held_out_by_both() -> bool:
            reasons = [await _reasons(u, "bad") for u in (a, b)]
            return sorted(map(str, reasons)) == ["['probe (another worker)']", "['probe']"]

        await _until(held_out_by_both, timeout_s=10.0)
        before = good.num_probes
        await asyncio.sleep(watch_s)
        num_probes = good.num_probes - before
    one_worker = watch_s / interval_s  # probes of one worker in the time (at most)
    assert 0 < num_probes <= 1.5 * one_worker, num_probes


async def _respond(url: str, previous: str | None) -> tuple[int, str, str]:
    """A Responses API turn through ``url`` on a fresh connection: (status, the backend
    that answered, the response's id)."""
    body: dict[str, object] = {"model": MODEL, "input": "next turn", "max_output_tokens": 2}
    if previous is not None:
        body["previous_response_id"] = previous
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + "/v1/responses", json=body) as r,
    ):
        data = await r.json()
        return r.status, r.headers.get(BACKEND_HEADER, ""), str(data.get("id", ""))


async def test_a_responses_follow_up_finds_its_backend_on_every_worker() -> None:
    """vLLM (and the twin) keep a Responses conversation on the engine that answered
    it; any other answers 404. Worker A relays the first turn; the follow-ups, on new
    connections through worker B, go to the same twin (``routing.shared_responses``),
    at once. Before, B had never seen the id and round robin spread them: 404s."""
    async with twins({}, {}, {}) as servers:
        args = [a for t in servers for a in ("--backend", t.url)]
        async with _workers(*args, "--policy", "round_robin") as (url, proc):
            a, b = await _private_urls(url, proc.pid)
            status, owner, previous = await _respond(a, None)
            assert status == 200 and previous.startswith("resp_")
            for turn in range(4):
                worker = (b, a)[turn % 2]
                status, got, previous = await _respond(worker, previous)
                assert (status, got) == (200, owner), turn
            # found through the shared ids, not by asking the twins in turn (the
            # fallback for an id no worker knows: ApiHooks.is_elsewhere)
            retries = "kiloserve_gateway_retries_total"
            assert await _own_metric(a, retries) + await _own_metric(b, retries) == 0
