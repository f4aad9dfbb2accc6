"""A real Prometheus scraping a running gateway and engine twins on 127.0.0.1 (issue 9).

Prometheus (Debian's ``prometheus`` package, installed by scripts/ensure_tools.sh) runs
with deploy/prometheus/prometheus.yml, its file discovery swapped for static targets
(the gateway and two twins started here), a 1 s scrape and rule interval and
deploy/prometheus/alerts.yml. The test reads back a gateway counter and an engine
counter through ``/api/v1/query`` and checks the exact request counts, checks that
every alert rule evaluates without error, and runs every Grafana dashboard query so a
PromQL mistake fails here. Prometheus is stopped (and its temp storage removed) at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from test_gateway_fakes import gateway_config, running_gateway
from test_gateway_twins import MODEL, twins

from conftest import REPO, free_port
from kiloserve import __version__

PROMETHEUS = Path("/usr/bin/prometheus")
PROM_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
NUM_REQUESTS = 3

pytestmark = pytest.mark.skipif(
    not PROMETHEUS.exists(),
    reason="prometheus not installed: run scripts/ensure_tools.sh (Debian package prometheus)",
)


def scrape_config(gateway: str, engines: list[str]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with static targets and 1 s intervals."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    targets = {"kiloserve-gateway": [gateway], "vllm-engine": engines}
    jobs = []
    for job in cfg["scrape_configs"]:
        if job["job_name"] in targets:
            del job["file_sd_configs"]
            job.pop("scrape_interval", None)
            job.pop("scrape_timeout", None)
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            jobs.append(job)
    cfg["scrape_configs"] = jobs
    return cfg


@contextlib.asynccontextmanager
async def running_prometheus(cfg: dict[str, Any], workdir: Path) -> AsyncIterator[str]:
    """Start Prometheus on a free 127.0.0.1 port; yield its URL; stop it afterwards."""
    shutil.copy(PROM_DIR / "alerts.yml", workdir / "alerts.yml")
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        str(PROMETHEUS),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(url, proc, workdir / "prometheus.log")
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def _wait_ready(url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            if proc.returncode is not None:
                raise AssertionError(f"prometheus exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/-/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError("prometheus never became ready")


async def query(s: aiohttp.ClientSession, url: str, promql: str) -> list[dict[str, Any]]:
    async with s.get(url + "/api/v1/query", params={"query": promql}) as r:
        body = await r.json()
    assert body["status"] == "success", (promql, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def wait_for_value(
    s: aiohttp.ClientSession, url: str, promql: str, expected: float, timeout_s: float = 15.0
) -> None:
    seen: list[dict[str, Any]] = []
    for _ in range(int(timeout_s / 0.25)):
        seen = await query(s, url, promql)
        if seen and float(seen[0]["value"][1]) == expected:
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"{promql}: wanted {expected}, Prometheus has {seen}")


async def _send_requests(gateway_url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for i in range(NUM_REQUESTS):
            body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4}
            async with s.post(gateway_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()


def _dashboard_queries() -> list[str]:
    subs = {"$gateway_job": "kiloserve-gateway", "$engine_job": "vllm-engine",
            "$__rate_interval": "5s"}  # fmt: skip
    out = []
    for path in sorted(GRAFANA_DIR.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for key, value in subs.items():
                    expr = expr.replace(key, value)
                out.append(expr)
    return out


async def _rules_health(s: aiohttp.ClientSession, url: str) -> list[tuple[str, str, str]]:
    async with s.get(url + "/api/v1/rules") as r:
        groups = (await r.json())["data"]["groups"]
    return [
        (rule["name"], rule["health"], rule.get("lastError", ""))
        for g in groups
        for rule in g["rules"]
    ]


async def _wait_rules_evaluated(s: aiohttp.ClientSession, url: str) -> list[tuple[str, str, str]]:
    rules: list[tuple[str, str, str]] = []
    for _ in range(60):
        rules = await _rules_health(s, url)
        if rules and all(health != "unknown" for _, health, _ in rules):
            break
        await asyncio.sleep(0.25)
    return rules


async def test_prometheus_scrapes_gateway_and_twins(tmp_path: Path) -> None:
    async with twins({}, {}) as servers:
        backends = [{"url": t.url, "name": f"twin{i}"} for i, t in enumerate(servers)]
        cfg = gateway_config(backends, policy={"name": "default"})
        async with running_gateway(cfg) as gw_url:
            await _send_requests(gw_url)
            hostport = gw_url.removeprefix("http://")
            engines = [t.url.removeprefix("http://") for t in servers]
            prom_cfg = scrape_config(hostport, engines)
            async with (
                running_prometheus(prom_cfg, tmp_path) as prom,
                aiohttp.ClientSession() as s,
            ):
                await wait_for_value(
                    s, prom, 'sum(kiloserve_gateway_requests_total{job="kiloserve-gateway",'
                    'status="200"})', NUM_REQUESTS
                )  # fmt: skip
                await wait_for_value(
                    s, prom, 'sum(vllm:request_success_total{job="vllm-engine",'
                    'finished_reason="length"})', NUM_REQUESTS
                )  # fmt: skip
                await wait_for_value(s, prom, 'count(up{job="vllm-engine"} == 1)', 2)
                healthy = await query(s, prom, "sum(kiloserve_gateway_backend_healthy)")
                assert float(healthy[0]["value"][1]) == 2
                info = await query(s, prom, "kiloserve_gateway_info")
                backend_info = await query(s, prom, "kiloserve_backend_info")
                deployment = await _admin(s, gw_url)
                rules = await _wait_rules_evaluated(s, prom)
                for expr in _dashboard_queries():
                    await query(s, prom, expr)  # raises on a PromQL error
    assert len(rules) == 16
    assert [r for r in rules if r[1] != "ok"] == []
    _check_deployment_records(info, backend_info, deployment)


async def _admin(s: aiohttp.ClientSession, gw_url: str) -> dict[str, Any]:
    async with s.get(gw_url + "/admin/backends") as r:
        backends = await r.json()
    async with s.get(gw_url + "/admin/config") as r:
        config = await r.json()
    assert backends["deployment"] == config["deployment"]
    return {"deployment": config["deployment"], "backends": backends["backends"]}


def _check_deployment_records(
    info: list[dict[str, Any]], backend_info: list[dict[str, Any]], admin: dict[str, Any]
) -> None:
    """S5.5: version and config hash in the info metric equal the admin API's."""
    (gateway,) = info
    labels = gateway["metric"]
    assert labels["version"] == __version__ == admin["deployment"]["version"]
    assert re.fullmatch(r"[0-9a-f]{16}", labels["config_hash"])
    assert labels["config_hash"] == admin["deployment"]["config_hash"]
    rows = {(b["metric"]["backend"], b["metric"]["model"]) for b in backend_info}
    assert (
        rows
        == {(b["name"], MODEL) for b in admin["backends"]}
        == {("twin0", MODEL), ("twin1", MODEL)}
    )
