"""The drill environment: twins (``LocalCluster``), the gateway, and for ``etcd`` mode a
local etcd plus one ``kiloserve agent`` per engine. Also the levers the scenarios pull
(kill / restart a backend, its fault API, drain) and what they read back from the
gateway (``/admin/backends``, ``/metrics``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kiloserve.chaos.etcd import LocalEtcd
from kiloserve.launch.cluster import LocalCluster, free_port, gateway_config
from kiloserve.launch.config import ClusterConfig
from kiloserve.launch.process import ChildProcess

__all__ = ["DRILL_GATEWAY_OPTIONS", "DrillEnv"]

# Drill defaults (a cluster file's gateway.options override them): probes every second,
# a 2 s first-byte deadline (a hung backend's request moves on), demotion to 0.1 judged
# on small windows (3..10 samples) so a short drill sees it.
DRILL_GATEWAY_OPTIONS: dict[str, Any] = {
    "first_byte_timeout_s": 2.0,
    "retries": 2,
    "health": {
        "interval_s": 1.0, "timeout_s": 0.5, "recheck_interval_s": 0.1,
        "unhealthy_threshold": 2, "healthy_threshold": 2,
    },
    "outlier": {"consecutive_gateway_failures": 3, "base_ejection_time_s": 2.0},
    "demotion": {
        "demoted_weight": 0.1, "window_s": 10.0, "max_num_samples": 10, "min_num_samples": 3,
        "slow_start_s": 3.0,
    },
}  # fmt: skip


class DrillEnv:
    """Start with ``start()`` (blocking), stop with ``stop()``; ``etcd`` mode on request."""

    def __init__(self, cfg: ClusterConfig, run_dir: Path, *, use_etcd: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.cluster = LocalCluster(cfg, gateway=False, run_dir=run_dir)
        self.etcd = LocalEtcd(run_dir / "etcd-data") if use_etcd else None
        self.agents: list[ChildProcess] = []
        self.gateway: ChildProcess | None = None
        self.session: aiohttp.ClientSession | None = None

    @property
    def gateway_url(self) -> str:
        if self.gateway is None:
            raise RuntimeError("the drill environment is not started")
        return self.gateway.url

    def names(self) -> list[str]:
        return [b.name for b in self.cluster.backends]

    def start(self) -> None:
        try:
            self.cluster.start()
            if self.etcd is not None:
                self.etcd.start()
                for info in self.cluster.backends:
                    self.agents.append(self._agent(info.name, info.url, info.model))
            self._start_gateway()
        except BaseException:
            self.stop()
            raise

    def _agent(self, name: str, url: str, model: str) -> ChildProcess:
        assert self.etcd is not None
        argv = [
            sys.executable, "-m", "kiloserve", "agent", "--engine-url", url,
            "--etcd", self.etcd.endpoint, "--name", name, "--model", model,
            "--ttl", "3", "--interval", "0.5", "--no-nvml",
        ]  # fmt: skip
        child = ChildProcess(f"agent-{name}", argv, url, self.run_dir / f"agent-{name}.log")
        child.start()
        return child

    def _gateway_conf(self, port: int) -> dict[str, Any]:
        conf = gateway_config(self.cfg, self.cluster.backends, port)
        for key, value in {**DRILL_GATEWAY_OPTIONS, **self.cfg.gateway.options}.items():
            conf[key] = value
        if self.etcd is not None:
            conf["backends"] = []
            conf["registry"] = {
                "kind": "etcd",
                "etcd": [self.etcd.endpoint],
                "retry_interval_s": 0.5,
            }
        return conf

    def _start_gateway(self) -> None:
        gw = self.cfg.gateway
        port = gw.port or free_port(gw.host)
        path = self.run_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(self._gateway_conf(port), sort_keys=False))
        argv = [sys.executable, "-m", "kiloserve", "gateway", "-c", str(path)]
        self.gateway = ChildProcess(
            "gateway", argv, f"http://{gw.host}:{port}", self.run_dir / "gateway.log",
            health_path="/ready",
        )  # fmt: skip
        self.gateway.start()
        self.gateway.wait_healthy(60.0)

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for agent in self.agents:
            agent.stop()
        if self.etcd is not None:
            self.etcd.stop()
        self.cluster.stop()

    # -- levers --------------------------------------------------------------------
    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.cluster.children if c.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL the backend's process group (a crash: no goodbye)."""
        child = self.child(name)
        if child.proc is not None and child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()

    async def restart(self, name: str, *, graceful: bool = False) -> None:
        """Stop (SIGTERM if ``graceful``, else nothing: it is dead) and start it again."""
        child = self.child(name)
        if graceful:
            await asyncio.to_thread(child.stop)
        child.start()
        await asyncio.to_thread(child.wait_healthy, 60.0)

    async def _http(self, method: str, url: str, body: Any = None) -> Any:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        # the drill's own processes inherit $KILOSERVE_ADMIN_TOKEN when the user set it
        token = os.environ.get("KILOSERVE_ADMIN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        async with self.session.request(method, url, json=body, headers=headers) as resp:
            if resp.content_type == "application/json":
                return await resp.json()
            return await resp.text()

    async def faults(self, name: str, body: dict[str, Any]) -> None:
        await self._http("POST", self.child(name).url + "/admin/faults", body)

    async def drain(self, name: str, draining: bool) -> None:
        verb = "drain" if draining else "undrain"
        await self._http("POST", f"{self.gateway_url}/admin/backends/{name}/{verb}")

    async def backends(self) -> dict[str, dict[str, Any]]:
        data = await self._http("GET", self.gateway_url + "/admin/backends")
        return {row["name"]: row for row in data["backends"]}

    async def metrics_text(self) -> str:
        """The gateway's ``/metrics`` exposition text."""
        return str(await self._http("GET", self.gateway_url + "/metrics"))

    async def metric(self, prefix: str) -> float:
        """The sum of the series whose line starts with ``prefix`` (counters: the
        gateway's whole count)."""
        return sum(await self.metric_values(prefix))

    async def metric_values(self, prefix: str) -> list[float]:
        """Each series whose line starts with ``prefix``: a gauge of a gateway with
        several workers has one per worker (a ``worker`` label)."""
        text = await self.metrics_text()
        return [
            float(line.rsplit(" ", 1)[1])
            for line in str(text).splitlines()
            if line.startswith(prefix)
        ]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
