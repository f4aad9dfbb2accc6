"""``kiloserve gateway [-c FILE] [--backend URL ...] [--policy NAME] [--host H] [--port P]``.

``--backend`` (repeatable) adds a backend whose models are discovered from its
``/v1/models``, so a quick start needs no YAML. ``--port 0`` picks a free port; the
URL actually bound is logged and printed. SIGHUP (or ``POST /admin/reload``) reads the
file and the flags again and applies what can change live (``gateway/reload.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kiloserve.gateway.app import create_gateway_app, make_runner
from kiloserve.gateway.config import (
    BackendConfig,
    GatewayConfig,
    PolicyConfig,
    load_gateway_config,
    parse_gateway_config,
    resolve_workers,
)
from kiloserve.gateway.loop import LoopError, loop_factory
from kiloserve.gateway.reload import RELOAD_KEY, install_signal
from kiloserve.gateway.tasks import stop_tasks
from kiloserve.gateway.workers import attach_worker, run_workers, watch_supervisor
from kiloserve.routing.shared_load import SharedLoad

__all__ = ["add_arguments", "build_config", "reload_args", "run", "serve"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", help="gateway YAML file (see docs/gateway.md)")
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="backend base URL (repeatable); models come from its /v1/models",
    )
    parser.add_argument("--policy", help="routing policy registry name (default: 'default')")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="bind port (default 8000; 0 picks one)")
    parser.add_argument(
        "--loop",
        choices=["auto", "uvloop", "asyncio"],
        help="event loop (default auto: uvloop when installed)",
    )
    parser.add_argument(
        "--workers",
        type=_workers,
        help="processes serving the port with SO_REUSEPORT and one shared in-flight "
        "view, or 'auto': one per usable CPU (the cores this process may run on, capped "
        "by its container's CPU limit; the default); 1: one process, no supervisor "
        "(docs/gateway.md, 'Workers')",
    )


def _workers(text: str) -> int | str:
    """``--workers``: a whole number, or ``auto`` (argparse names the flag otherwise)."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number or 'auto', got {text!r}")
    return int(text)


def build_config(args: argparse.Namespace) -> GatewayConfig:
    """The config file (if any) with the command-line flags applied on top."""
    cfg = load_gateway_config(args.config) if args.config else parse_gateway_config({})
    updates: dict[str, object] = {}
    if args.backend:
        extra = [BackendConfig(url=url) for url in args.backend]
        updates["backends"] = [*cfg.backends, *extra]
    if args.policy:
        updates["policy"] = PolicyConfig(name=args.policy)
    if args.host:
        updates["host"] = args.host
    if args.port is not None:
        updates["port"] = args.port
    if getattr(args, "loop", None):
        updates["event_loop"] = args.loop
    if getattr(args, "workers", None) is not None:
        updates["workers"] = resolve_workers(args.workers)
    merged = cfg.model_copy(update=updates)
    # validate the merged result (duplicate backends, port range)
    return parse_gateway_config(merged.model_dump(), source="gateway flags")


def reload_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags ``build_config`` reads, as JSON (a worker rebuilds its config from them)."""
    names = ("config", "backend", "policy", "host", "port", "loop", "workers")
    return {n: getattr(args, n, None) for n in names}


async def serve(
    cfg: GatewayConfig,
    stop: asyncio.Event | None = None,
    *,
    shared: SharedLoad | None = None,
    worker: int | None = None,
    source: Callable[[], GatewayConfig] | None = None,
    supervisor: int | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT / SIGTERM, or, in a worker, until its
    ``supervisor`` process is gone: ``workers.watch_supervisor``).

    ``worker``: this process is worker ``worker`` of ``kiloserve gateway --workers N``
    (gateway/workers.py): it binds the port with SO_REUSEPORT beside its peers and
    shares their in-flight view through ``shared``. ``source``: the config again, for
    SIGHUP and ``POST /admin/reload`` (gateway/reload.py).
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    # On stop: close the listening socket, let in-flight requests (streams included)
    # finish for up to shutdown_grace_s, then cancel what is left and exit.
    # make_runner: handler_cancellation, no access log, the request-head timeout and
    # the connection cap (gateway/limits.py)
    app = create_gateway_app(cfg)
    if shared is not None:
        attach_worker(app, cfg, shared, worker or 0)
    reloader = app[RELOAD_KEY]
    reloader.source = source
    if worker is not None:  # POST /admin/reload: the supervisor reloads every worker
        reloader.fan_out = lambda: os.kill(os.getppid(), signal.SIGHUP)
    install_signal(loop, reloader)
    runner = make_runner(app, cfg, shutdown_timeout=cfg.shutdown_grace_s)
    await runner.setup()
    watch = None if supervisor is None else asyncio.create_task(watch_supervisor(supervisor, stop))
    try:
        if shared is not None:  # a private port: this worker's own pages for siblings,
            # published before the shared port listens (a sibling's /ready counts it then)
            private = web.TCPSite(runner, "127.0.0.1", 0)
            await private.start()
            shared.set_port(runner.addresses[-1][1])
        first = len(runner.addresses)
        reuse = True if worker is not None else None  # SO_REUSEPORT beside the peers
        site = web.TCPSite(runner, cfg.host, cfg.port, reuse_port=reuse)
        await site.start()
        host, port = runner.addresses[first][:2]
        url = f"http://{host}:{port}"
        who = "kiloserve gateway" if worker is None else f"kiloserve gateway worker {worker}"
        logger.info("%s listening on %s", who, url)
        print(f"{who} listening on {url}", flush=True)
        await stop.wait()
        logger.info("stopping: in-flight requests get up to %.0f s", cfg.shutdown_grace_s)
    finally:
        if watch is not None:
            await stop_tasks([watch])
        await runner.cleanup()


def run_one(
    cfg: GatewayConfig,
    *,
    shared: SharedLoad | None = None,
    worker: int | None = None,
    source: Callable[[], GatewayConfig] | None = None,
    supervisor: int | None = None,
) -> None:
    """Serve ``cfg`` in this process on the configured event loop (gateway/loop.py)."""
    factory, name = loop_factory(cfg.event_loop)
    logger.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(cfg, shared=shared, worker=worker, source=source, supervisor=supervisor))


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    source = (lambda: build_config(args)) if args.config else None
    try:
        if cfg.workers > 1:
            return run_workers(cfg, args.log_level, reload_args(args) if source else None)
        run_one(cfg, source=source)
    except LoopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
