"""A throw-away local etcd for the ``etcd-down`` drill (Debian's ``etcd-server``)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from kiloserve.errors import ConfigError
from kiloserve.launch.cluster import free_port

__all__ = ["LocalEtcd"]


class LocalEtcd:
    """One etcd member on 127.0.0.1 with free ports; ``stop`` / ``start`` keep its data."""

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise ConfigError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.data_dir = data_dir
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.peer_url = f"http://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> None:
        client = f"http://{self.endpoint}"
        argv = [
            self.binary, "--name", "chaos", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"chaos={self.peer_url}",
        ]  # fmt: skip
        with (self.data_dir.parent / "etcd.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(client + "/health", timeout=0.5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise ConfigError(f"etcd did not start within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
