"""Routing quality on the twin cluster: default policy vs round robin vs least request.

    .venv/bin/python benchmarks/routing_quality.py [--num-requests 300] [--rate 9]

Two experiments, every policy on a fresh cluster with the identical request sequence:

1. ``examples/cluster.yaml`` (Llama pool: 2 x H100, 2 x A100, 1 x L40S) under a mixed
   workload (chat + long documents + short prompts, with shared prefixes).
   Targets (issue #3): P99 TTFT <= 0.5x round robin and <= 0.8x least_request.
2. The same cluster with one H100 made 4x slower (twin fault ``slowdown: 4``), against
   the same cluster without that backend. Target: the default policy's P99 E2E on the
   slow-backend cluster within 1.5x of the cluster without it.

3. ``--experiment fakes`` (live, seconds): four in-process fake OpenAI backends, one
   4x slower, each with ``--fake-seats`` seats and a ``/metrics`` page whose KV usage
   reads high without a queue (blocks kept as prefix cache: ``0.6 + 0.002`` per request
   served, at most 0.99); closed-loop non-streamed clients through the gateway. Target
   (docs/policies.md): the default policy's throughput and P99 within 10% of
   ``least_request``. Wall-clock numbers: on a busy machine compare the ratios only.

Prints each figure with its ratio and met / NOT met; reports under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from kiloserve.bench.client import ClientOptions  # noqa: E402
from kiloserve.bench.compare import compare_policies  # noqa: E402
from kiloserve.gateway.app import create_gateway_app  # noqa: E402
from kiloserve.gateway.config import parse_gateway_config  # noqa: E402
from kiloserve.launch.config import ClusterConfig, load_cluster_config  # noqa: E402
from kiloserve.workload import OpenLoop, load_workload  # noqa: E402

MODEL = "Llama-3.1-8B"
WORKLOAD = "mix:chat=0.6,longdoc=0.1,short=0.3"


def llama_only(
    cfg: ClusterConfig, slow: str | None = None, drop: str | None = None
) -> ClusterConfig:
    """The Llama pool of ``cfg``; ``slow`` gets a 4x slowdown, ``drop`` is left out."""
    data: dict[str, Any] = cfg.model_dump(mode="json", exclude_none=True)
    backends = []
    for b in data["backends"]:
        if b["model"] != "llama-3.1-8b":
            continue
        items = [b] if b.get("count", 1) == 1 else _split(b)
        for item in items:
            if item["name"] == drop:
                continue
            if item["name"] == slow:
                item["faults"] = {"slowdown": 4.0}
            backends.append(item)
    data["backends"] = backends
    return ClusterConfig.model_validate(data)


def _split(b: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**b, "name": f"{b['name']}-{i}", "count": 1} for i in range(b["count"])]


def _p(summary: dict[str, Any], key: str, stat: str) -> float:
    return float(summary[key][stat])


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "NOT met"


def run(args: argparse.Namespace) -> int:
    base = load_cluster_config(REPO / "examples" / "cluster.yaml")
    options = ClientOptions(timeout_s=300)

    def workload() -> Any:
        return load_workload(WORKLOAD, seed=args.seed, num_requests=args.num_requests,
                             rate=args.rate)  # fmt: skip

    def go(cfg: ClusterConfig, policies: list[str], name: str) -> dict[str, dict[str, Any]]:
        runs = compare_policies(
            cfg, policies, workload, OpenLoop(None), model=MODEL, out_dir=args.out / name,
            options=options, seed=args.seed, plot=not args.no_plots,
            on_policy=lambda p: print(f"[{name}] {p} ...", flush=True),
        )  # fmt: skip
        return {r.policy: r.summary for r in runs}

    mixed = go(llama_only(base), ["round_robin", "least_request", "default"], "mixed")
    print((args.out / "mixed" / "comparison.md").read_text())
    d, rr, lr = mixed["default"], mixed["round_robin"], mixed["least_request"]
    r1 = _p(d, "ttft_ms", "p99") / _p(rr, "ttft_ms", "p99")
    r2 = _p(d, "ttft_ms", "p99") / _p(lr, "ttft_ms", "p99")
    slow = go(llama_only(base, slow="h100-llama-1"), ["default"], "slow-backend")
    ref = go(llama_only(base, drop="h100-llama-1"), ["default"], "without-slow-backend")
    r3 = _p(slow["default"], "e2e_ms", "p99") / _p(ref["default"], "e2e_ms", "p99")
    print("\n## Targets (issue #3)")
    print(f"P99 TTFT default / round_robin   = {r1:.2f}  (target <= 0.50: {_verdict(r1, 0.5)})")
    print(f"P99 TTFT default / least_request = {r2:.2f}  (target <= 0.80: {_verdict(r2, 0.8)})")
    print(f"P99 E2E slow-backend / without   = {r3:.2f}  (target <= 1.50: {_verdict(r3, 1.5)})")
    return 0


class FakeEngine:
    """An OpenAI-ish completion server: ``num_seats`` requests at a time, each taking
    ``delay_s``; ``/metrics`` in vLLM's names with a KV usage that grows as it serves."""

    def __init__(self, delay_s: float, num_seats: int) -> None:
        self.delay_s, self.seats = delay_s, asyncio.Semaphore(num_seats)
        self.num_active = self.num_running = self.num_served = 0
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.num_active += 1
        try:
            async with self.seats:
                self.num_running += 1
                await asyncio.sleep(self.delay_s)
                self.num_running -= 1
        finally:
            self.num_active -= 1
        self.num_served += 1
        usage = {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}
        choice = {"index": 0, "text": "x" * 16, "finish_reason": "length"}
        return web.json_response({"id": "c", "object": "text_completion",
                                  "choices": [choice], "usage": usage})  # fmt: skip

    async def _metrics(self, request: web.Request) -> web.Response:
        kv = min(0.99, 0.6 + 0.002 * self.num_served)
        waiting = self.num_active - self.num_running
        return web.Response(text=f'vllm:num_requests_running{{model_name="m"}} {self.num_running}\n'
                                 f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
                                 f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n')  # fmt: skip

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self.runner, self.url = await _serve(app)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1, a free port; returns its runner and base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _closed_loop(url: str, num_clients: int, duration_s: float) -> list[float]:
    body = {"model": "m", "prompt": "hello", "max_tokens": 16}
    latencies_s: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end_s = time.monotonic() + duration_s

        async def client() -> None:
            while (start_s := time.monotonic()) < end_s:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                latencies_s.append(time.monotonic() - start_s)

        await asyncio.gather(*(client() for _ in range(num_clients)))
    return latencies_s


async def _fake_run(policy: str, args: argparse.Namespace) -> tuple[float, float]:
    """(requests/s, P99 E2E s) of ``policy`` on fresh fakes and a fresh gateway."""
    engines = [FakeEngine(args.fake_delay * (4.0 if i == 0 else 1.0), args.fake_seats)
               for i in range(4)]  # fmt: skip
    runners: list[web.AppRunner] = []
    try:
        for e in engines:
            await e.start()
            assert e.runner is not None
            runners.append(e.runner)
        cfg = parse_gateway_config({
            "port": 0, "scrape_interval_s": 0.1, "policy": {"name": policy},
            "backends": [{"name": f"b{i}", "url": e.url, "models": ["m"]}
                         for i, e in enumerate(engines)],
        })  # fmt: skip
        runner, url = await _serve(create_gateway_app(cfg))
        runners.append(runner)
        await asyncio.sleep(0.5)  # first scrapes
        latencies_s = sorted(await _closed_loop(url, args.fake_clients, args.fake_duration))
    finally:
        for r in reversed(runners):
            await r.cleanup()
    return len(latencies_s) / args.fake_duration, latencies_s[int(0.99 * len(latencies_s))]


def run_fakes(args: argparse.Namespace) -> None:
    print(f"\n## One backend 4x slower: 4 fake backends, {args.fake_clients} closed-loop "
          f"non-streamed clients, {args.fake_duration:.0f} s per policy")  # fmt: skip
    results = {p: asyncio.run(_fake_run(p, args)) for p in ("least_request", "default")}
    for policy, (rps, p99_s) in results.items():
        print(f"{policy:>14}: {rps:7.1f} req/s  P99 E2E {p99_s * 1000:6.0f} ms")
    (lr_rps, lr_p99), (d_rps, d_p99) = results["least_request"], results["default"]
    r_rps, r_p99 = d_rps / lr_rps, d_p99 / lr_p99
    print(f"default / least_request: throughput {r_rps:.2f} (target >= 0.90: "
          f"{'met' if r_rps >= 0.9 else 'NOT met'}), P99 {r_p99:.2f} "
          f"(target <= 1.10: {_verdict(r_p99, 1.1)})")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiment", choices=("all", "twins", "fakes"), default="all")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=9.0, help="requests/s")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "routing-quality")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--fake-clients", type=int, default=24)
    p.add_argument("--fake-seats", type=int, default=8, help="concurrent requests per fake")
    p.add_argument("--fake-delay", type=float, default=0.1, help="s per request (fast fakes)")
    p.add_argument("--fake-duration", type=float, default=10.0, help="s per policy")
    args = p.parse_args()
    if args.experiment in ("all", "fakes"):
        run_fakes(args)
    return run(args) if args.experiment in ("all", "twins") else 0


if __name__ == "__main__":
    sys.exit(main())
