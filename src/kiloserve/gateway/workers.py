"""``kiloserve gateway --workers N``: N gateway processes on one port, one in-flight view.

The supervisor (this module's ``run_workers``, the process the user started) does no
proxying. It fixes the port (``port: 0`` is resolved once, and kept reserved by a bound
socket that never listens), creates the shared load segment
(``routing.shared_load``) and a lock file beside it, and starts N workers
(``python -m kiloserve.gateway.workers``, the settings on stdin). Each worker is a
whole gateway: it binds the port with ``SO_REUSEPORT`` (the kernel spreads new
connections across the workers), routes with its own policy and table, and shares
its in-flight and outstanding-token counts, the operator's drains and its health
verdicts (probe failures, ejections, demotions) and where it sent which prefix with
the others through the segment, so every worker routes on the load of all of them,
avoids what any of them found broken or slow, and follows the prefixes all of them
placed.

The supervisor prints one ``kiloserve gateway listening on URL`` line (the same as a
single process's; its log says how many workers) once every worker listens (worker 0
first: a config the app refuses ends the gateway with its error and exit 2), forwards
the workers' other output, restarts a worker that dies
(the new one first retires what the dead one still counted), and on SIGINT / SIGTERM
stops them all (each gets ``shutdown_grace_s`` for its in-flight requests). A worker
whose supervisor is gone (killed with SIGKILL, say) stops the same way within
``SUPERVISOR_CHECK_S``: it never keeps the port on its own, beside a new supervisor's
workers, with a view nobody else shares (``watch_supervisor``). On SIGHUP
(sent by an operator, or by a worker answering ``POST /admin/reload``) it reads the
config file again and, when it is valid and changes nothing that needs a restart,
sends SIGHUP to every worker, each of which reloads the same file
(``gateway/reload.py``); a refused reload is logged and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from aiohttp import web

from kiloserve.errors import KiloserveError
from kiloserve.gateway.admission.gate import FLOW_KEY
from kiloserve.gateway.admission.ratelimit import LocalLimiter, SharedLimiter
from kiloserve.gateway.admission.shared_queue import SharedQueues
from kiloserve.gateway.app import (
    CTX_KEY,
    RESILIENCE_KEY,
    SCRAPE_SHARE_KEY,
    TABLE_KEY,
    WORKER_METRICS_KEY,
)
from kiloserve.gateway.config import GatewayConfig, parse_gateway_config
from kiloserve.gateway.dashboard import DASHBOARD_SIBLINGS_KEY
from kiloserve.gateway.extra_apis import OWNERS_KEY
from kiloserve.gateway.lora import LORA_KEY
from kiloserve.gateway.lora_shared import SharedLora
from kiloserve.gateway.peers import PEERS_KEY
from kiloserve.gateway.reload import restart_fields
from kiloserve.gateway.scrape import follow_age_s
from kiloserve.gateway.worker_metrics import WorkerMetrics
from kiloserve.routing.shared_load import FileLock, LoadLayout, SharedLoad
from kiloserve.routing.shared_prefixes import SharedPrefixes
from kiloserve.routing.shared_responses import SharedResponses
from kiloserve.routing.shared_verdicts import SharedVerdicts

__all__ = ["attach_worker", "run_workers", "worker_main"]

logger = logging.getLogger(__name__)

_READY = " listening on "
_RESTART_LIMIT = 5  # restarts within _RESTART_WINDOW_S before the supervisor gives up
_RESTART_WINDOW_S = 60.0
SUPERVISOR_CHECK_S = 0.5  # how often a worker checks that its supervisor still lives


def _reserve_port(host: str) -> socket.socket:
    """A socket bound to ``host``:0 with SO_REUSEPORT (never listening): the port the
    workers share, held for the supervisor's lifetime so nothing else takes it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock


class _Worker:
    """One worker process and the thread that forwards its stdout."""

    def __init__(self, index: int, spec: dict[str, object]) -> None:
        self.index = index
        self.ready = threading.Event()
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiloserve.gateway.workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**spec, "worker": index}))
        self.proc.stdin.close()
        self._thread = threading.Thread(target=self._forward, daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if _READY in line and not self.ready.is_set():
                self.ready.set()
                continue
            sys.stdout.write(line)
            sys.stdout.flush()


def run_workers(
    cfg: GatewayConfig, log_level: str | None = None, reload: dict[str, object] | None = None
) -> int:
    """Supervise ``cfg.workers`` gateway workers until SIGINT / SIGTERM; ``reload``:
    the command-line flags the config came from (``cli.reload_args``), for SIGHUP."""
    stop, hup = threading.Event(), threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, lambda _sig, _frame: hup.set())
    reserve = _reserve_port(cfg.host) if cfg.port == 0 else None
    port = reserve.getsockname()[1] if reserve is not None else cfg.port
    cfg = cfg.model_copy(update={"port": port})
    load = SharedLoad.create(LoadLayout(workers=cfg.workers))
    lock_path = str(Path(tempfile.gettempdir()) / f"kiloserve-{load.name}.lock")
    level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
    spec: dict[str, object] = {
        "config": cfg.model_dump(mode="json"),
        "segment": load.name,
        "lock": lock_path,
        "log_level": level,
        "reload": {**reload, "port": port} if reload else None,
        "supervisor": os.getpid(),
    }
    workers: list[_Worker] = []
    try:
        FileLock(lock_path).close()  # create it before any worker opens it
        # worker 0 first: a config the app refuses (an unknown policy, say) stops the
        # gateway with worker 0's one error line and exit 2, as one process would
        workers = [_Worker(0, spec)]
        deadline = time.monotonic() + 60.0
        for i in range(cfg.workers):
            w = workers[i]
            while not w.ready.wait(0.1):
                if stop.is_set():  # SIGTERM while starting (worker 0 may serve already)
                    return 0
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    if w.proc.poll() == 2:  # it said why (worker_main)
                        return 2
                    print("kiloserve gateway: a worker did not start", file=sys.stderr)
                    return 1
            if i == 0:
                workers += [_Worker(j, spec) for j in range(1, cfg.workers)]
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        url = f"http://{host}:{port}"
        logger.info("kiloserve gateway listening on %s (%d workers)", url, cfg.workers)
        # the same line as one process's: scripts take the URL from its end
        print(f"kiloserve gateway listening on {url}", flush=True)
        return _supervise(workers, spec, stop, hup)
    finally:
        _stop_all(workers, cfg.shutdown_grace_s + 10.0)
        load.close()
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        if reserve is not None:
            reserve.close()


def _reload_all(workers: list[_Worker], spec: dict[str, object]) -> None:
    """SIGHUP: check the file once here, then have every worker reload it."""
    flags = spec.get("reload")
    if not isinstance(flags, dict):
        logger.warning("SIGHUP: the gateway was started without a config file; ignored")
        return
    from kiloserve.gateway.cli import build_config  # the cli imports this module

    current = parse_gateway_config(spec["config"], source="gateway workers")
    try:
        new = build_config(argparse.Namespace(**flags))
    except KiloserveError as exc:
        logger.warning("config reload refused, nothing changed: %s", exc)
        return
    fixed = restart_fields(current, new)
    if fixed:
        logger.warning("config reload refused, nothing changed: %s need a restart", fixed)
        return
    spec["config"] = new.model_dump(mode="json")  # for workers started from now on
    for w in workers:
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGHUP)
    logger.info("config reload: SIGHUP sent to %d workers", len(workers))


def _supervise(
    workers: list[_Worker], spec: dict[str, object], stop: threading.Event, hup: threading.Event
) -> int:
    restarts: list[float] = []
    while not stop.wait(0.2):
        if hup.is_set():
            hup.clear()
            _reload_all(workers, spec)
        for i, w in enumerate(workers):
            rc = w.proc.poll()
            if rc is None:
                continue
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < _RESTART_WINDOW_S] + [now]
            if len(restarts) > _RESTART_LIMIT:
                logger.error("workers keep dying (%d restarts in %.0f s): stopping",
                             len(restarts) - 1, _RESTART_WINDOW_S)  # fmt: skip
                return 1
            logger.warning("gateway worker %d exited (%s): starting a new one", i, rc)
            workers[i] = _Worker(i, spec)
    return 0


def _stop_all(workers: list[_Worker], grace_s: float) -> None:
    for w in workers:
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        try:
            w.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def attach_worker(
    app: web.Application, cfg: GatewayConfig, shared: SharedLoad, worker: int
) -> None:
    """Wire worker ``worker``'s gateway app to the segment, before it starts: the
    table's counts and drains (through the peer channel's share when ``peers`` is on,
    which then ignores its siblings), the merged ``/metrics``, the scrapes (worker 0
    scrapes for all), the rate-limit buckets, the health verdicts (probe failures,
    ejections and demotions: ``routing.shared_verdicts``), the prefix placements
    of the approximate index (``routing.shared_prefixes``), the Responses API ids
    (``routing.shared_responses``), the admission queues'
    order (``gateway/admission/shared_queue.py``) and the LoRA loads
    (``gateway/lora_shared.py``); the dashboard answers for all of them
    (``gateway/dashboard_merge.py``)."""
    table = app[TABLE_KEY]
    peers = app.get(PEERS_KEY)
    if peers is not None:  # other gateways through Redis, siblings through memory
        peers.join_workers(shared, instance=shared.name)
    else:
        table.shared = shared
    shared.resync(table.state_or_none)  # the siblings' counts (no peers yet)
    app[WORKER_METRICS_KEY] = WorkerMetrics(
        worker, shared.ports, cfg.metrics_token, workers=shared.layout.workers
    )
    app[DASHBOARD_SIBLINGS_KEY] = app[WORKER_METRICS_KEY]
    app[SCRAPE_SHARE_KEY] = (shared, worker == 0)
    verdicts = SharedVerdicts(shared)
    verdicts.clear()  # a dead predecessor's verdicts stop counting
    app[RESILIENCE_KEY].share = verdicts
    shared.on_sample = app[RESILIENCE_KEY].on_sibling_sample  # the demoter sees all traffic
    if worker != 0:  # worker 0 probes for all while it lives (as it scrapes for all)
        max_age_s = follow_age_s(cfg.scrape_interval_s, cfg.scrape_timeout_s)
        app[RESILIENCE_KEY].probed_elsewhere = _scraped_lately(shared, max_age_s)
    router = app[CTX_KEY].router
    prefixes = SharedPrefixes(shared)
    router.before_decide = lambda: prefixes.pull(router.policy)
    owners = app.get(OWNERS_KEY)
    if owners is not None:  # a Responses follow-up finds its backend on every worker
        owners.share = SharedResponses(shared)
    lora = app.get(LORA_KEY)
    if lora is not None:
        lora.shared = SharedLora(shared, worker)
    flow = app.get(FLOW_KEY)
    if flow is not None and isinstance(flow.limiter, LocalLimiter):
        flow.limiter = SharedLimiter(shared)
    if flow is not None and flow.admission is not None:
        queues = SharedQueues(shared, cfg.admission.max_queue_wait_s)
        queues.clear()  # a dead predecessor's queue heads stop counting
        flow.admission.share = queues


def _scraped_lately(shared: SharedLoad, max_age_s: float) -> Callable[[str], bool]:
    """Whether worker 0 published a scrape of the backend in the last ``max_age_s``:
    it is alive, so it probes the backend too (its verdicts reach every worker); a
    worker probes for itself only while worker 0 is silent (restarting)."""

    def fresh(backend_id: str) -> bool:
        got = shared.get_scrape(backend_id)
        return got is not None and time.monotonic() - got[1] <= max_age_s

    return fresh


async def watch_supervisor(
    pid: int, stop: asyncio.Event, interval_s: float = SUPERVISOR_CHECK_S
) -> None:
    """Set ``stop`` once process ``pid`` (the supervisor that started this worker) is no
    longer its parent: it died, by SIGKILL too, and this worker is an orphan."""
    while not stop.is_set():
        if os.getppid() != pid:
            logger.warning("the supervisor (pid %d) is gone: this worker stops", pid)
            stop.set()
            return
        await asyncio.sleep(interval_s)


def worker_main() -> int:
    """A worker: its settings as JSON on stdin (written by ``run_workers``)."""
    spec = json.loads(sys.stdin.read())
    index = int(spec["worker"])
    logging.basicConfig(
        level=str(spec.get("log_level", "INFO")).upper(),
        format=f"%(asctime)s worker-{index} %(levelname)s %(name)s: %(message)s",
    )
    from kiloserve.gateway.cli import build_config, run_one  # the gateway app, only in workers

    cfg = parse_gateway_config(spec["config"], source="gateway workers")
    flags = spec.get("reload")
    source = (lambda: build_config(argparse.Namespace(**flags))) if flags else None
    lock = FileLock(str(spec["lock"]))
    shared = SharedLoad.attach(str(spec["segment"]), index, lock)
    retired = shared.retire_predecessor()
    if retired:
        logger.info("retired the in-flight counts a dead worker left on %d backends", retired)
    try:
        supervisor = spec.get("supervisor")
        run_one(
            cfg,
            shared=shared,
            worker=index,
            source=source,
            supervisor=int(supervisor) if isinstance(supervisor, int) else None,
        )
    except KiloserveError as exc:  # a config the app refuses: one line, as the CLI says it
        print(f"kiloserve gateway: error: {exc}", file=sys.stderr)
        return 2
    finally:
        shared.close()
        lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
