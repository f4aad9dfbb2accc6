"""The gateway's own work per request, in process: no sockets, no HTTP server.

    .venv/bin/python benchmarks/handler_work.py [--requests 20000] [--rounds 5]

What the gateway does for one non-streamed completion besides the HTTP server and
the upstream client (``gateway/app.py``'s ``_proxy`` and ``gateway/proxy.py``):
parse the body (orjson), profile it (``Profiler.profile``: tokens, session key,
prefix block hashes), the routing decision (``Router.decide``: the policy), the
accounting of the attempt (``Router.dispatch``, ``first_token``, ``complete``) and
the encoding of an answer of the engine's size. Four backends of one model, with a
scrape recorded for each (idle engines), as in ``benchmarks/gateway_overhead.py``;
bodies of the same shape as its load (a 16-token completion of a short prompt).

Prints the CPU per request (``time.process_time``, best of ``--rounds`` rounds) for
``round_robin`` and ``default``, each stage on its own and the whole path, and the
ratio of the default policy's path to round robin's measured in the same run. This
is the part of issue 16's per-request cost (target: <= 100 us in all, server and
client included) that a faster front door would not remove.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kiloserve.gateway.app import create_policy_for
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.profile import Profiler
from kiloserve.policies.base import RequestInfo
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable

MODEL = "m"
ANSWER = {
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "text": " tok" * 16, "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
}  # fmt: skip


def _router(policy: str) -> tuple[Router, Profiler]:
    backends = [
        {"url": f"http://127.0.0.1:{9000 + i}", "name": f"b{i}", "models": [MODEL]}
        for i in range(4)
    ]
    cfg = parse_gateway_config({"backends": backends, "policy": {"name": policy}})
    table = BackendTable(cfg)
    now = time.monotonic()
    for b in table.backend_ids():
        table.record_scrape(b, EngineMetrics("vllm", 0, 0, 0.0), now)
    return Router(table, create_policy_for(cfg), random.Random(0)), Profiler(cfg)


def _bodies(n: int) -> list[bytes]:
    return [
        orjson.dumps({"model": MODEL, "prompt": f"request {i}: say hello", "max_tokens": 16})
        for i in range(n)
    ]


def _best_us(run: Callable[[], None], n: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        run()
        best = min(best, (time.process_time() - started) / n * 1e6)
    return best


def measure(policy: str, n: int, rounds: int) -> dict[str, float]:
    router, prof = _router(policy)
    raws = _bodies(n)
    bodies = [orjson.loads(r) for r in raws]
    infos: list[RequestInfo] = [prof.profile(str(i), b, {}) for i, b in enumerate(bodies)]
    headers: dict[str, str] = {}

    def parse() -> None:
        for raw in raws:
            orjson.loads(raw)

    def profile() -> None:
        for i, body in enumerate(bodies):
            prof.profile(str(i), body, headers)

    def decide() -> None:
        now = time.monotonic()
        for info in infos:
            router.decide(info, now)

    def account() -> None:
        for info in infos:
            _attempt(router, "b0", info)

    def encode() -> None:
        for _ in range(n):
            orjson.dumps(ANSWER)

    def whole() -> None:
        for i, raw in enumerate(raws):
            body = orjson.loads(raw)
            info = prof.profile(str(i), body, headers)
            decision = router.decide(info, time.monotonic())
            _attempt(router, decision.ranked[0], info)
            orjson.dumps(ANSWER)

    stages = {"parse": parse, "profile": profile, "decide": decide, "account": account}
    out = {name: _best_us(run, n, rounds) for name, run in {**stages, "encode": encode}.items()}
    out["whole"] = _best_us(whole, n, rounds)
    return out


def _attempt(router: Router, backend_id: str, info: RequestInfo) -> None:
    started = time.monotonic()
    attempt = router.attempt_info(info, None, backend_id)
    router.dispatch(backend_id, attempt)
    router.first_token(backend_id, attempt, 1.0)
    router.complete(
        backend_id, attempt, ok=True, status=200, started_s=started,
        first_token_s=started + 0.001, last_token_s=started + 0.002, output_tokens=16,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rows: dict[str, dict[str, Any]] = {}
    for policy in ("round_robin", "default"):
        rows[policy] = measure(policy, args.requests, args.rounds)
    cols = ("parse", "profile", "decide", "account", "encode", "whole")
    print(f"CPU us per request, best of {args.rounds} rounds of {args.requests:,}")
    print(f"{'policy':<12}" + "".join(f"{c:>10}" for c in cols))
    for policy, row in rows.items():
        print(f"{policy:<12}" + "".join(f"{row[c]:>10.1f}" for c in cols))
    ratio = rows["default"]["whole"] / rows["round_robin"]["whole"]
    print(f"default / round_robin, whole path, same run: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
