"""Run drills: steady load, a fault, the gateway's reaction, a report per scenario.

``run_drills(cfg, scenarios, opts, out_dir)`` starts one static environment for every
scenario that does not need etcd (run one after another, each waiting for a settled
cluster first) and one etcd environment for ``etcd-down``, and writes
``out_dir/report.json``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import orjson

from kiloserve.chaos.env import DrillEnv
from kiloserve.chaos.load import LoadGenerator
from kiloserve.chaos.report import Timeline, build_report
from kiloserve.chaos.scenarios import SCENARIOS, DrillOptions, Scenario
from kiloserve.errors import ConfigError
from kiloserve.launch.config import ClusterConfig

__all__ = ["run_drills", "run_scenario"]

logger = logging.getLogger(__name__)

_SETTLE_S = 30.0
_RECOVER_S = 30.0


async def _watch(env: DrillEnv, scenario: Scenario, victim: str, detect: bool) -> float:
    """Poll until the scenario's detected (or recovered) check holds; returns when."""
    check = scenario.detected if detect else scenario.recovered
    assert check is not None
    while not await check(env, victim):
        await asyncio.sleep(0.05)
    return time.monotonic()


async def _settle(env: DrillEnv) -> None:
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline:
        rows = await env.backends()
        if len(rows) == len(env.names()) and all(
            r["routable"] and r["effective_weight"] >= 1.0 - 1e-9 for r in rows.values()
        ):
            return
        await asyncio.sleep(0.1)
    raise ConfigError("the cluster did not settle (all backends healthy, full weight)")


async def _finish(task: asyncio.Task[float], timeout_s: float) -> float | None:
    try:
        return await asyncio.wait_for(task, timeout_s)
    except TimeoutError:
        return None


async def run_scenario(env: DrillEnv, scenario: Scenario, opts: DrillOptions) -> dict[str, Any]:
    victim = env.names()[opts.victim]
    model = env.cluster.backends[opts.victim].model
    await _settle(env)
    retried_before = await env.metric("kiloserve_gateway_retries_total")
    load = LoadGenerator(env.gateway_url, model, opts.concurrency, opts.max_tokens, opts.seed)
    t = Timeline(start_s=time.monotonic())
    await load.start()
    await asyncio.sleep(opts.before_s)
    t.fault_s = time.monotonic()
    detect = asyncio.create_task(_watch(env, scenario, victim, True)) if scenario.detected else None
    await scenario.fault(env, victim, opts, t)
    recover = asyncio.create_task(_watch(env, scenario, victim, False))
    await asyncio.sleep(opts.after_s)
    await load.stop()
    t.end_s = time.monotonic()
    if detect is not None:
        detected_at = await _finish(detect, 0.0 if detect.done() else 0.01)
        t.detect_s = None if detected_at is None else detected_at - t.fault_s
    recovered_at = await _finish(recover, _RECOVER_S)
    t.recover_s = None if recovered_at is None else max(0.0, recovered_at - t.clear_s)
    retried = int(await env.metric("kiloserve_gateway_retries_total") - retried_before)
    report = build_report(load.results, t, retried)
    report["victim"] = victim
    logger.info("%s: %s", scenario.name, {k: report[k] for k in ("sent", "failed", "detect_s")})
    return report


async def _run_env(
    cfg: ClusterConfig, names: list[str], opts: DrillOptions, run_dir: Path, use_etcd: bool
) -> dict[str, Any]:
    env = DrillEnv(cfg, run_dir, use_etcd=use_etcd)
    await asyncio.to_thread(env.start)
    try:
        out = {}
        for name in names:
            out[name] = await run_scenario(env, SCENARIOS[name], opts)
        return out
    finally:
        await env.close()
        await asyncio.to_thread(env.stop)


async def run_drills(
    cfg: ClusterConfig, names: list[str], opts: DrillOptions, out_dir: Path
) -> dict[str, Any]:
    """Run ``names`` (in order, etcd ones last) and write ``out_dir/report.json``."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ConfigError(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
    if not 0 <= opts.victim < len(cfg.expanded()):
        raise ConfigError(f"victim index {opts.victim} is not a backend of the cluster")
    out_dir.mkdir(parents=True, exist_ok=True)
    static = [n for n in names if not SCENARIOS[n].needs_etcd]
    etcd = [n for n in names if SCENARIOS[n].needs_etcd]
    report: dict[str, Any] = {}
    if static:
        report |= await _run_env(cfg, static, opts, out_dir / "static", use_etcd=False)
    if etcd:
        report |= await _run_env(cfg, etcd, opts, out_dir / "etcd", use_etcd=True)
    report = {n: report[n] for n in names}
    (out_dir / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report
