"""Two gateways behind HAProxy (deploy/haproxy/haproxy.cfg) over the same engine twins.

S7.1: an L4 layer in front of several stateless gateways; any gateway can fail and is
removed by the L4 layer. Everything runs as real processes on 127.0.0.1: three twins
(``kiloserve engine``, one slowed down so routing matters), two ``kiloserve gateway``
processes with the same static backend list, and Debian's ``haproxy`` started with the
shipped config (only the server lines and the bind addresses are replaced).

1. Killing one gateway (SIGKILL, a crash) under load loses no request that had not
   started: every request sent after the kill succeeds (HAProxy retries a refused
   connection and redispatches it to the other gateway until the health check on
   ``/ready`` takes the dead one out). Requests in flight on the killed gateway may fail.
2. Routing quality: the same workload (100 requests, open loop at 25/s, fixed seed)
   through HAProxy to one gateway and to two gateways, each on fresh twins (a warm
   prefix cache would favour the second run). The asserted figure is the routing
   distance: the share of requests the two gateways together sent to a different
   backend than one gateway did (total variation distance of the per-backend shares),
   at most 10%; both runs must also keep the slow backend under 25% of the traffic.
   Mean and P95 TTFT are printed, not asserted: on a shared 2-core box they vary by
   10-20% from run to run, and two peer gateways measure about 10% slower than one at
   equal shares (docs/deployment.md has the numbers and the control run).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from test_ratelimit_redis import REDIS, redis_url  # noqa: F401 - the fixture

from conftest import REPO, free_port
from kiloserve.bench.client import run_bench
from kiloserve.launch.process import ChildProcess
from kiloserve.results.metrics import summarize
from kiloserve.workload import OpenLoop, load_workload

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
MODEL = "Llama-3.1-8B"
SLOWDOWNS = (4.0, 4.0, 10.0)  # one slow backend: routing has something to get right
WORKLOAD = "synthetic:input=uniform(300,900),output=fixed(16)"
NUM_REQUESTS = 100
RATE = 25.0
MAX_ROUTING_DISTANCE = 0.10  # at most 10% of requests routed differently

pytestmark = pytest.mark.skipif(
    not Path(HAPROXY).exists(),
    reason="haproxy not installed: run scripts/ensure_tools.sh (Debian package haproxy)",
)


def _python_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiloserve", *args]


def _start(children: list[ChildProcess], child: ChildProcess, timeout_s: float = 30.0) -> None:
    children.append(child)
    child.start()
    child.wait_healthy(timeout_s)


def _twins(run_dir: Path) -> list[ChildProcess]:
    children = []
    for i, slowdown in enumerate(SLOWDOWNS):
        port = free_port()
        argv = _python_argv("engine", "--gpu", "H100-SXM", "--model", "llama-3.1-8b",
                            "--port", str(port), "--slowdown", str(slowdown),
                            "--log-level", "WARNING")  # fmt: skip
        children.append(ChildProcess(f"twin{i}", argv, f"http://127.0.0.1:{port}",
                                     run_dir / f"twin{i}.log"))  # fmt: skip
    return children


def _gateway(
    run_dir: Path, name: str, twin_urls: list[str], peers_redis: str | None = None
) -> ChildProcess:
    port = free_port()
    cfg = {
        "host": "127.0.0.1",
        "port": port,
        "policy": {"name": "default"},
        "scrape_interval_s": 0.2,
        "seed": 7,
        "workers": 1,  # one process per gateway: the subject is gateways, not workers
        "backends": [
            {"url": url, "name": f"twin{i}", "models": [MODEL], "gpu": "H100"}
            for i, url in enumerate(twin_urls)
        ],
    }
    if peers_redis is not None:  # share the in-flight view (gateway/peers.py)
        cfg["peers"] = {"enabled": True, "redis_url": peers_redis}
    path = run_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = _python_argv("gateway", "-c", str(path), "--log-level", "WARNING")
    return ChildProcess(name, argv, f"http://127.0.0.1:{port}", run_dir / f"{name}.log",
                        health_path="/ready")  # fmt: skip


def haproxy_config(gateway_urls: list[str], port: int, stats_port: int) -> str:
    """The shipped haproxy.cfg with these gateways and 127.0.0.1 bind addresses."""
    text = HAPROXY_CFG.read_text()
    servers = "".join(
        f"    server gw{i} {url.removeprefix('http://')} check\n"
        for i, url in enumerate(gateway_urls, start=1)
    )
    text, num = re.subn(r"    # BEGIN gateways\n.*?    # END gateways\n", servers, text, flags=re.S)
    text = text.replace("bind 0.0.0.0:8000", f"bind 127.0.0.1:{port}")
    text = text.replace("bind 127.0.0.1:8404", f"bind 127.0.0.1:{stats_port}")
    if num != 1 or f":{port}" not in text:
        raise AssertionError("haproxy.cfg lost its BEGIN/END gateways markers or bind line")
    return text


@dataclass
class Stack:
    """HAProxy in front of gateways; ``url`` is what clients use."""

    url: str
    gateways: list[ChildProcess]
    stats_url: str
    children: list[ChildProcess] = field(default_factory=list)


def _start_stack(run_dir: Path, num_gateways: int, peers_redis: str | None = None) -> Stack:
    """Fresh twins (empty prefix caches), the gateways, then HAProxy."""
    children: list[ChildProcess] = []
    try:
        twins = _twins(run_dir)
        urls = [t.url for t in twins]
        gateways = [
            _gateway(run_dir, f"gw{i}", urls, peers_redis) for i in range(1, num_gateways + 1)
        ]
        for child in [*twins, *gateways]:
            children.append(child)
            child.start()
        for child in [*twins, *gateways]:
            child.wait_healthy(30.0)
        port, stats_port = free_port(), free_port()
        cfg_path = run_dir / "haproxy.cfg"
        cfg_path.write_text(haproxy_config([g.url for g in gateways], port, stats_port))
        stats_url = f"http://127.0.0.1:{stats_port}"
        lb = ChildProcess("haproxy", [HAPROXY, "-db", "-f", str(cfg_path)], stats_url,
                          run_dir / "haproxy.log", health_path="/stats")  # fmt: skip
        _start(children, lb, 10.0)
        return Stack(f"http://127.0.0.1:{port}", gateways, stats_url, children)
    except BaseException:
        for child in children:
            child.stop()
        raise


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[object]:
    stacks: list[Stack] = []

    def make(num_gateways: int, name: str, peers_redis: str | None = None) -> Stack:
        run_dir = tmp_path / name
        run_dir.mkdir()
        stacks.append(_start_stack(run_dir, num_gateways, peers_redis))
        return stacks[-1]

    try:
        yield make
    finally:
        for stack in stacks:
            for child in reversed(stack.children):
                child.stop(grace_s=3.0)


async def _wait_all_backends_up(url: str) -> None:
    """Every gateway behind HAProxy has fresh metrics of all three twins."""
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            async with s.get(url + "/admin/backends") as r:
                view = (await r.json())["backends"]
            if all(b["routable"] and not b["scrape_stale"] for b in view):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"backends never all fresh: {view}")


async def _bench(url: str) -> dict[str, object]:
    workload = load_workload(WORKLOAD, seed=11, num_requests=NUM_REQUESTS, rate=RATE)
    return summarize(await run_bench(url, MODEL, workload, OpenLoop()))


def shares(summary: dict[str, object]) -> dict[str, float]:
    """Each backend's share of the requests of one run."""
    per_backend = summary["per_backend"]
    assert isinstance(per_backend, dict)
    total = sum(int(v["count"]) for v in per_backend.values())
    return {b: int(v["count"]) / total for b, v in per_backend.items()}


def routing_distance(one: dict[str, float], two: dict[str, float]) -> float:
    """Total variation distance: the share of requests two gateways routed differently."""
    backends = set(one) | set(two)
    return 0.5 * sum(abs(one.get(b, 0.0) - two.get(b, 0.0)) for b in backends)


def test_routing_distance() -> None:
    assert routing_distance({"a": 0.5, "b": 0.5}, {"a": 0.5, "b": 0.5}) == 0.0
    assert routing_distance({"a": 0.86, "c": 0.14}, {"a": 0.67, "c": 0.33}) == pytest.approx(0.19)
    assert routing_distance({"a": 1.0}, {"b": 1.0}) == 1.0


async def test_two_gateways_route_as_well_as_one(stack_factory: object) -> None:
    await _one_vs_two(stack_factory, None)


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
async def test_two_peered_gateways_route_as_well_as_one(
    stack_factory: object,
    redis_url: str,  # noqa: F811 - the fixture
) -> None:
    """The same with ``peers`` on (gateway/peers.py): each sees the other's requests."""
    await _one_vs_two(stack_factory, redis_url)


async def _one_vs_two(stack_factory: object, peers_redis: str | None) -> None:
    make = stack_factory
    summaries = {}
    for num_gateways in (1, 2):
        redis = peers_redis if num_gateways == 2 else None
        stack = make(num_gateways, f"n{num_gateways}", redis)  # type: ignore[operator]
        for gw in stack.gateways:
            await _wait_all_backends_up(gw.url)
        summaries[num_gateways] = await _bench(stack.url)
        for child in reversed(stack.children):  # free the CPU for the next run
            child.stop(grace_s=3.0)
    for summary in summaries.values():
        assert summary["requests_failed"] == 0, summary["errors"]
    report = {n: _figures(s) for n, s in summaries.items()}
    distance = routing_distance(shares(summaries[1]), shares(summaries[2]))
    ttft_ratio = report[2]["ttft_mean_ms"] / report[1]["ttft_mean_ms"]
    print(f"routing quality, one vs two gateways: {report}; routing distance "
          f"{distance:.3f}, mean TTFT ratio {ttft_ratio:.2f}")  # fmt: skip
    for summary in summaries.values():  # the policy does avoid the slow backend
        assert shares(summary)["twin2"] < 0.25, report
    assert distance <= MAX_ROUTING_DISTANCE, report


def _figures(summary: dict[str, object]) -> dict[str, Any]:
    ttft = summary["ttft_ms"]
    assert isinstance(ttft, dict)
    return {
        "ttft_mean_ms": round(ttft["mean"], 1),
        "ttft_p95_ms": round(ttft["p95"], 1),
        "shares": {b: round(s, 2) for b, s in shares(summary).items()},
    }


@dataclass
class Outcome:
    start_s: float
    end_s: float
    error: str | None


async def _one_request(s: aiohttp.ClientSession, url: str, i: int) -> Outcome:
    start = time.monotonic()
    body = {"model": MODEL, "prompt": f"request {i} " * 20, "max_tokens": 8}
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            data = await r.json()
            error = (
                None
                if r.status == 200 and data["usage"]["completion_tokens"] == 8
                else (f"HTTP {r.status}: {data}")
            )
    except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Outcome(start, time.monotonic(), error)


async def _load(url: str, until_s: float, concurrency: int) -> list[Outcome]:
    """``concurrency`` clients in a loop, a new TCP connection per request."""
    outcomes: list[Outcome] = []
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def client(k: int) -> None:
            i = 0
            while time.monotonic() < until_s:
                outcomes.append(await _one_request(s, url, k * 100_000 + i))
                i += 1

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return outcomes


async def _num_served(gateway_url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(gateway_url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kiloserve_gateway_requests_total{")
    )


async def _server_stats(stats_url: str, server: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as s, s.get(stats_url + "/stats;csv") as r:
        lines = (await r.text()).splitlines()
    header = lines[0].lstrip("# ").split(",")
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == "gateways" and row.get("svname") == server:
            return row
    raise AssertionError(f"no stats row for {server}")


async def test_killing_a_gateway_loses_no_request_that_had_not_started(
    stack_factory: object,
) -> None:
    stack: Stack = stack_factory(2, "kill")  # type: ignore[operator]
    victim, survivor = stack.gateways
    for gw in stack.gateways:
        await _wait_all_backends_up(gw.url)
    t0 = time.monotonic()
    load = asyncio.create_task(_load(stack.url, t0 + 3.5, concurrency=6))
    await asyncio.sleep(1.0)
    served_by_victim = await _num_served(victim.url)
    assert victim.proc is not None
    signal_s = time.monotonic()
    os.killpg(victim.proc.pid, signal.SIGKILL)  # a crash: no graceful shutdown
    while victim.proc.poll() is None:  # dead = reaped: its sockets are closed
        await asyncio.sleep(0.001)
    dead_s = time.monotonic()
    outcomes = await load
    before = [o for o in outcomes if o.start_s < dead_s]
    after = [o for o in outcomes if o.start_s >= dead_s]
    in_flight_at_kill = [o for o in before if o.end_s >= signal_s]
    lost = [o for o in before if o.error is not None]
    victim_row = await _server_stats(stack.stats_url, "gw1")
    print(f"served by the victim before the kill: {served_by_victim:.0f}; requests before "
          f"{len(before)}, after {len(after)}, in flight at the kill {len(in_flight_at_kill)}, "
          f"lost {len(lost)}; haproxy gw1 status {victim_row['status']} retries "
          f"{victim_row['wretr']} redispatches {victim_row['wredis']}")  # fmt: skip
    assert served_by_victim > 0  # the killed gateway was carrying traffic
    assert len(after) >= 30
    assert [o.error for o in after if o.error is not None] == []
    assert all(o in in_flight_at_kill for o in lost)
    assert victim_row["status"].startswith("DOWN")
    assert int(victim_row["wredis"]) >= 1  # refused connections went to the survivor
    assert await _num_served(survivor.url) > 0
