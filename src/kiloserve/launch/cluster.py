"""A local cluster of engines (and the gateway in front), one process each.

Engines are twins by default; a backend line with ``engine: vllm | sglang | llama.cpp``
starts that real engine instead (``launch/engines.py`` builds each command line).

``LocalCluster`` is a context manager used by ``kiloserve up``, ``kiloserve compare``
and the tests::

    with LocalCluster(load_cluster_config("examples/cluster.yaml")) as cluster:
        print(cluster.gateway_url, [b.url for b in cluster.backends])
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kiloserve.errors import LaunchError
from kiloserve.launch.config import ClusterConfig, ExpandedBackend
from kiloserve.launch.engines import (
    METRIC_DIALECTS,
    KvEventsEndpoints,
    engine_launch,
    kv_events_endpoints,
    num_kv_events_ports,
)
from kiloserve.launch.process import ChildProcess

__all__ = [
    "BackendInfo",
    "LocalCluster",
    "describe_backend",
    "free_port",
    "free_ports",
    "gateway_config",
]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(host: str, num_ports: int) -> list[int]:
    """``num_ports`` distinct ports that were free a moment ago (bound all at once)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(num_ports)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


@dataclass(frozen=True)
class BackendInfo:
    """What ``kiloserve up`` prints per backend."""

    name: str
    url: str
    gpu: str
    model: str
    tp: int
    quant: str
    kv_capacity_tokens: int
    group: str
    version: str
    cost_per_hour: float
    weight: float
    engine: str = "twin"
    role: str = "both"  # disaggregated prefill/decode: prefill | decode | both
    kv_events_endpoint: str | None = None  # where the gateway subscribes (connects)
    kv_events_replay_endpoint: str | None = None


def describe_backend(item: ExpandedBackend, url: str) -> BackendInfo:
    from kiloserve.catalog import get_gpu, get_model
    from kiloserve.catalog.memory import plan_memory

    spec = item.spec
    if spec.engine != "twin":
        return describe_real_backend(item, url)
    gpu, model = get_gpu(spec.gpu), get_model(spec.model)
    ledger = plan_memory(gpu, model, tp=spec.tp, quant=spec.quant)  # raises DoesNotFitError
    cost = spec.cost_per_hour if spec.cost_per_hour is not None else gpu.cost_per_hour * spec.tp
    return BackendInfo(
        name=item.name,
        url=url,
        gpu=gpu.name,
        model=spec.served_model_name or model.name,
        tp=spec.tp,
        quant=spec.quant,
        kv_capacity_tokens=ledger.kv_capacity_tokens,
        group=spec.group,
        version=spec.version,
        cost_per_hour=cost,
        weight=spec.weight,
        role=spec.role,
    )


def _with_kv_events(info: BackendInfo, kv_events: KvEventsEndpoints | None) -> BackendInfo:
    if kv_events is None:
        return info
    return replace(
        info,
        kv_events_endpoint=kv_events.endpoint,
        kv_events_replay_endpoint=kv_events.replay_endpoint,
    )


def describe_real_backend(item: ExpandedBackend, url: str) -> BackendInfo:
    """A real engine: its KV capacity is the engine's own business (0 = not planned)."""
    spec = item.spec
    return BackendInfo(
        name=item.name,
        url=url,
        gpu=spec.gpu or "-",
        model=spec.served_model_name or spec.model,
        tp=spec.tp,
        quant=spec.quant,
        kv_capacity_tokens=0,
        group=spec.group,
        version=spec.version,
        cost_per_hour=spec.cost_per_hour or 0.0,
        weight=spec.weight,
        engine=spec.engine,
        role=spec.role,
    )


def gateway_config(cfg: ClusterConfig, backends: list[BackendInfo], port: int) -> dict[str, Any]:
    """The gateway YAML (``kiloserve gateway -c``) for this cluster's backends."""
    gw = cfg.gateway
    out: dict[str, Any] = {
        "host": gw.host,
        "port": port,
        "policy": {"name": gw.policy, "params": dict(gw.policy_params)},
        "backends": [
            {
                "name": b.name,
                "url": b.url,
                "models": [b.model],
                "gpu": b.gpu,
                "group": b.group,
                "version": b.version,
                "cost_per_hour": b.cost_per_hour,
                "weight": b.weight,
                "engine": METRIC_DIALECTS[b.engine],
                "kv_capacity_tokens": b.kv_capacity_tokens or None,
                **_tp_key(b),
                **_role_key(b),
                **_kv_events_keys(b),
                **_node_metrics_key(b),
            }
            for b in backends
        ],
    }
    out.update(gw.options)
    return out


def _tp_key(backend: BackendInfo) -> dict[str, int]:
    """The gateway's ``tp`` key (its default, 1, is left out): with ``gpu`` it gives
    the routing table a replica's prefill capability (the ``ttft`` scorer's prior)."""
    return {} if backend.tp == 1 else {"tp": backend.tp}


def _role_key(backend: BackendInfo) -> dict[str, str]:
    """The gateway's ``role`` key for a prefill or decode backend (``both``, the
    gateway's default, is left out: such a cluster's gateway YAML is unchanged)."""
    return {} if backend.role == "both" else {"role": backend.role}


def _kv_events_keys(backend: BackendInfo) -> dict[str, str]:
    """The gateway's ``kv_events_*`` keys for a backend that publishes KV events."""
    keys = {
        "kv_events_endpoint": backend.kv_events_endpoint,
        "kv_events_replay_endpoint": backend.kv_events_replay_endpoint,
    }
    return {key: value for key, value in keys.items() if value is not None}


def _node_metrics_key(backend: BackendInfo) -> dict[str, str]:
    """A twin's node page (its dcgm-exporter stand-in) for the gateway to scrape."""
    if backend.engine != "twin":
        return {}
    return {"node_metrics_url": backend.url + "/node/metrics"}


class LocalCluster:
    """Starts every engine, waits until all are healthy, then the gateway (optional)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        *,
        gateway: bool | None = None,
        policy: str | None = None,
        policy_params: dict[str, Any] | None = None,
        gateway_port: int | None = None,
        run_dir: Path | None = None,
        start_timeout_s: float = 60.0,
        gateway_options: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.with_gateway = cfg.gateway.enabled if gateway is None else gateway
        self.policy = policy or cfg.gateway.policy
        self.policy_params = cfg.gateway.policy_params if policy_params is None else policy_params
        self.gateway_port = cfg.gateway.port if gateway_port is None else gateway_port
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kiloserve-up-"))
        self.start_timeout_s = start_timeout_s
        self.gateway_options = dict(gateway_options or {})
        self.backends: list[BackendInfo] = []
        self.children: list[ChildProcess] = []
        self.gateway: ChildProcess | None = None

    @property
    def gateway_url(self) -> str | None:
        return self.gateway.url if self.gateway else None

    def start(self) -> None:
        host = self.cfg.host
        items = self.cfg.expanded()
        num_kv_ports = sum(num_kv_events_ports(it.spec) for it in items)
        all_ports = free_ports(host, len(items) + num_kv_ports)  # distinct, all of them
        ports, kv_ports = all_ports[: len(items)], iter(all_ports[len(items) :])
        kv_events = [kv_events_endpoints(it, host, self.run_dir, kv_ports) for it in items]
        # Validate every backend (catalog names, memory fit) before starting anything.
        self.backends = [
            _with_kv_events(describe_backend(it, f"http://{host}:{p}"), kv)
            for it, p, kv in zip(items, ports, kv_events, strict=True)
        ]
        timeouts_s: list[float] = []
        try:
            for it, port, info, kv in zip(items, ports, self.backends, kv_events, strict=True):
                launch = engine_launch(it, host, port, self.run_dir, kv)
                timeouts_s.append(max(self.start_timeout_s, launch.min_start_timeout_s))
                child = ChildProcess(
                    name=info.name,
                    argv=launch.argv,
                    url=info.url,
                    log_path=self.run_dir / f"{info.name}.log",
                    env=launch.env,
                    health_path=launch.health_path,
                )
                child.start()
                self.children.append(child)
            # Children start in parallel, so each wait is bounded by its own timeout.
            started_s = time.monotonic()
            for child, timeout_s in zip(self.children, timeouts_s, strict=True):
                child.wait_healthy(max(1.0, started_s + timeout_s - time.monotonic()))
            if self.with_gateway:
                self._start_gateway()
        except BaseException:
            self.stop()
            raise

    def _start_gateway(self) -> None:
        gw = self.cfg.gateway
        port = self.gateway_port or free_port(gw.host)
        conf = gateway_config(self.cfg, self.backends, port)
        conf["policy"] = {"name": self.policy, "params": dict(self.policy_params)}
        conf.update(self.gateway_options)
        path = self.run_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(conf, sort_keys=False))
        self.gateway = ChildProcess(
            name="gateway",
            argv=[sys.executable, "-m", "kiloserve", "gateway", "-c", str(path)],
            url=f"http://{gw.host}:{port}",
            log_path=self.run_dir / "gateway.log",
            health_path="/ready",
        )
        self.gateway.start()
        self.gateway.wait_healthy(self.start_timeout_s)

    def crashed(self) -> list[tuple[str, int]]:
        """Children that exited since the last call: (name, exit status), each reported once."""
        out: list[tuple[str, int]] = []
        for child in [*self.children, *([self.gateway] if self.gateway else [])]:
            code = child.exit_code()
            if code is not None and not child.reported_exit:
                child.reported_exit = True
                out.append((child.name, code))
        return out

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def stop(self) -> None:
        """Stop the gateway first (no new work), then every engine; every process is
        stopped even when stopping one fails, and the first failure is raised after."""
        failures: list[BaseException] = []
        for child in [*([self.gateway] if self.gateway else []), *self.children]:
            try:
                child.stop()
            except Exception as exc:  # re-raised below, after the rest are stopped
                log.warning("stopping %s failed: %s", child.name, exc)
                failures.append(exc)
        if failures:
            raise failures[0]

    def pids(self) -> list[int]:
        procs = [*self.children, *([self.gateway] if self.gateway else [])]
        return [p.pid for p in procs if p.pid is not None]

    def __enter__(self) -> LocalCluster:
        t0 = time.monotonic()
        self.start()
        log.info("cluster up in %.1f s (logs in %s)", time.monotonic() - t0, self.run_dir)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def raise_if_crashed(cluster: LocalCluster) -> None:
    """Raise LaunchError naming any child that exited (used by long-running callers)."""
    dead = cluster.crashed()
    if dead:
        names = ", ".join(f"{n} (status {c})" for n, c in dead)
        raise LaunchError(f"cluster processes exited: {names}; logs in {cluster.run_dir}")
