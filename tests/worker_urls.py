"""Reach each worker of a ``kiloserve gateway`` on its own (tests only).

With ``--workers N`` (``auto``, the default, on a machine with several cores) the port
the gateway listens on is shared with ``SO_REUSEPORT``: a request reaches whichever
worker the kernel picks. Each worker also serves the gateway on a private loopback
port (gateway/worker_metrics.py); these helpers find those ports from ``/proc``, so a
test can wait until *every* worker has seen something (each has its own KV-event
subscriber, for instance), not only the one that answered.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def children(pid: int) -> list[int]:
    """The supervisor's worker processes (not its resource tracker)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for c in (task / "children").read_text().split():
                cmd = Path(f"/proc/{c}/cmdline").read_bytes()
                if b"kiloserve.gateway.workers" in cmd:
                    out.append(int(c))
    return out


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on at 127.0.0.1 (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, state, inode = cols[1], cols[3], cols[9]
        if state == "0A" and inode in inodes and local.startswith("0100007F:"):
            ports.add(int(local.split(":")[1], 16))
    return ports


def worker_urls(url: str, pid: int) -> list[str]:
    """Each worker's private URL of the gateway at ``url`` whose process is ``pid``;
    ``[url]`` when that process serves alone (``--workers 1``). Call it once the
    gateway is ready (every worker has its private port by then)."""
    workers = children(pid)
    if not workers:
        return [url]
    shared_port = int(url.rsplit(":", 1)[1])
    urls = []
    for w in workers:
        (port,) = listening_ports(w) - {shared_port}
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def _listening_inodes() -> dict[str, int]:
    """Socket inode -> port of every TCP socket listening on this host's IPv4."""
    out = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A":
            out[cols[9]] = int(cols[1].split(":")[1], 16)
    return out


def gateway_workers(url: str) -> list[str]:
    """``worker_urls`` of the gateway at ``url`` without knowing its process: the
    processes that listen on its port (the workers, or the one process that serves it
    alone), found from ``/proc``. Call it on every read (a restarted worker has a new
    private port); it costs a few ms."""
    shared_port = int(url.rsplit(":", 1)[1])
    inodes = _listening_inodes()
    owners: dict[int, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        ports = set()
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        port = inodes.get(target[len("socket:[") : -1])
                        if port is not None:
                            ports.add(port)
        if shared_port in ports:
            owners[int(proc.name)] = ports - {shared_port}
    if len(owners) <= 1:
        return [url]
    return [f"http://127.0.0.1:{min(ports)}" for _, ports in sorted(owners.items()) if ports]


def merged_kv_rows(views: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The ``kv_events`` rows of ``/admin/config`` from every worker, one row per
    backend as the slowest worker holds it: ``blocks`` the fewest any worker indexed,
    ``max_blocks`` the most, ``mode`` the mode all share (else ``mixed``), ``gaps`` the
    most, ``resyncs`` / ``restarts`` summed (as ``/metrics`` sums the workers' counters:
    each worker counts what its own subscriber noticed, and a worker that had already
    dropped a dead engine's entries sees its restart as a fresh start). One
    worker's rows come back as they are, with ``max_blocks`` added."""
    merged: dict[str, dict[str, Any]] = {}
    for backend in views[0]:
        rows = [v[backend] for v in views]
        row = dict(min(rows, key=lambda r: r["blocks"]))
        modes = {r["mode"] for r in rows}
        row["mode"] = modes.pop() if len(modes) == 1 else "mixed"
        row["max_blocks"] = max(r["blocks"] for r in rows)
        row["gaps"] = max(r["gaps"] for r in rows)
        row["resyncs"] = sum(r["resyncs"] for r in rows)
        row["restarts"] = sum(r["restarts"] for r in rows)
        merged[backend] = row
    return merged
