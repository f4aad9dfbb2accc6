"""A real etcd (Debian's ``etcd-server``) on 127.0.0.1 with free ports and a temp data dir."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port

__all__ = ["EtcdProcess", "etcd_binary"]


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        pytest.skip("etcd not installed (scripts/ensure_tools.sh installs Debian's etcd-server)")
    return path


class EtcdProcess:
    """Start / stop / restart one etcd member; ``endpoint`` is HOST:PORT."""

    def __init__(self, data_dir: Path) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary, "--name", "t", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"t={peer}",
        ]  # fmt: skip
        log = (self.data_dir.parent / "etcd.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(client + "/health", timeout=0.5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
