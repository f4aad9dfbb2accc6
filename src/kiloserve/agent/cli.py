"""``kiloserve agent --engine-url URL --etcd HOST:PORT [--model M ...] [--name NAME]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from urllib.parse import urlsplit

import aiohttp
from pydantic import ValidationError

from kiloserve.agent.loop import Agent, AgentConfig
from kiloserve.errors import ConfigError
from kiloserve.gateway.registry.settings import DEFAULT_PREFIX
from kiloserve.routing.config import BackendConfig

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", required=True, help="the engine's base URL")
    parser.add_argument(
        "--etcd", action="append", required=True, metavar="HOST:PORT", help="etcd endpoint"
    )
    parser.add_argument("--model", action="append", default=[], help="served model (repeatable)")
    parser.add_argument("--name", help="backend name (default: the engine's host:port)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="etcd key prefix")
    parser.add_argument("--ttl", type=int, default=3, help="lease TTL in seconds (default 3)")
    parser.add_argument("--interval", type=float, default=1.0, help="check interval (s)")
    parser.add_argument("--gpu", default="", help="GPU name to advertise")
    parser.add_argument("--weight", type=float, default=1.0, help="routing weight")
    parser.add_argument("--no-nvml", action="store_true", help="skip NVML node health")
    parser.add_argument(
        "--dcgm-url",
        help="node health (temperature, Xid, ECC, NVLink) from this dcgm-exporter page "
        "instead of NVML, e.g. http://127.0.0.1:9400/metrics or a twin's /node/metrics; "
        "also advertised to the gateway as the backend's node_metrics_url",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        help="the engine's KV-event publisher for the gateway to subscribe to "
        "(tcp://host:port or ipc://path; docs/kv-events.md)",
    )
    parser.add_argument("--kv-events-replay-endpoint", help="its replay socket")


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    url = args.engine_url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"--engine-url must be http://host:port, got {args.engine_url!r}")
    if args.ttl < 1 or args.interval <= 0 or args.interval >= args.ttl:
        raise ConfigError("need --ttl >= 1 and 0 < --interval < --ttl (keep-alives beat expiry)")
    return AgentConfig(
        engine_url=url, etcd=list(args.etcd), name=args.name or parts.netloc,
        models=list(args.model), prefix=args.prefix, ttl_s=args.ttl, interval_s=args.interval,
        gpu=args.gpu, weight=args.weight, is_nvml_enabled=not args.no_nvml,
        dcgm_url=_backend_field(args.dcgm_url, "--dcgm-url", "node_metrics_url"),
        kv_events_endpoint=_backend_field(
            args.kv_events_endpoint, "--kv-events-endpoint", "kv_events_endpoint"
        ),
        kv_events_replay_endpoint=_backend_field(
            args.kv_events_replay_endpoint, "--kv-events-replay-endpoint",
            "kv_events_replay_endpoint",
        ),
    )  # fmt: skip


def _backend_field(value: str | None, flag: str, field: str) -> str | None:
    """``value`` checked by the rule of ``BackendConfig.<field>`` (an error names ``flag``)."""
    if value is None:
        return None
    try:
        BackendConfig.model_validate({"url": "http://x:1", field: value})
    except ValidationError as exc:
        raise ConfigError(f"{flag}: {exc.errors()[0]['msg']}") from exc
    return value


async def _main(cfg: AgentConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await Agent(cfg, session).run(stop)


def run(args: argparse.Namespace) -> int:
    asyncio.run(_main(config_from_args(args)))
    return 0
