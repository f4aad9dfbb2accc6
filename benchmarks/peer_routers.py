"""The routers our users compare us with (nginx, the Rust routers), as in-run references.

``gateway_overhead.py`` measures kiloserve's gateway next to nginx and, when they are
installed, next to SGLang's model gateway (``sglang-router``, PyPI) and vLLM's router
(``vllm-router``, PyPI): the same instant backends, the same load, one run. Both are
Rust servers shipped in Python wheels; a Python entry point starts the Rust router
in-process (tokio threads), so the process's CPU time is the router's.

``scripts/peer_routers.sh`` (``make peer-routers``; ``make test`` runs it) installs the
pinned versions below into their own virtual environment, ``$KILOSERVE_CACHE/peer-routers``
(default ``~/.cache/kiloserve/peer-routers``), apart from kiloserve's own: they are
benchmark references, not dependencies. ``find_routers`` looks there, then on ``PATH``.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PINS", "PeerRouter", "find_routers", "nginx_conf", "peer_venv", "wait_ready"]

# the versions scripts/peer_routers.sh installs (the figures in docs/gateway.md are theirs)
PINS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}


def peer_venv() -> Path:
    """Where ``scripts/peer_routers.sh`` installs the routers."""
    cache = os.environ.get("KILOSERVE_CACHE")
    if cache:
        return Path(cache) / "peer-routers"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiloserve" / "peer-routers"


@dataclass(frozen=True)
class PeerRouter:
    """One installed router: its name in reports and its executable."""

    name: str
    exe: str

    def command(
        self, port: int, metrics_port: int, backend_ports: list[int], policy: str
    ) -> list[str]:
        """The command line serving ``port`` in front of ``backend_ports`` with ``policy``
        (``round_robin``, ``random``, ``power_of_two`` or ``cache_aware`` on both)."""
        workers = [f"http://127.0.0.1:{p}" for p in backend_ports]
        common = [
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port),
        ]  # fmt: skip
        if self.name == "sglang-router":
            return [self.exe, "launch", *common, "--log-level", "warn"]
        return [self.exe, *common, "--log-level", "warning"]


def find_routers(names: list[str] | None = None) -> tuple[list[PeerRouter], list[str]]:
    """The routers found (the cache's venv first, then ``PATH``), and one line per
    router not found saying how to get it."""
    found: list[PeerRouter] = []
    missing: list[str] = []
    venv_bin = peer_venv() / "bin"
    for name in names if names is not None else list(PINS):
        exe = venv_bin / name
        path = str(exe) if exe.is_file() and os.access(exe, os.X_OK) else shutil.which(name)
        if path is None:
            missing.append(f"{name}: not installed, skipping it (make peer-routers)")
        else:
            found.append(PeerRouter(name, path))
    return found, missing


def nginx_conf(tmp: Path, port: int, backend_ports: list[int]) -> Path:
    servers = "".join(f"    server 127.0.0.1:{p};\n" for p in backend_ports)
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"""daemon off;
master_process off;
worker_processes 1;
error_log {tmp}/nginx_error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream backends {{
{servers}    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{port};
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""
    )
    return conf


def wait_ready(port: int, model: str, timeout_s: float = 30.0) -> None:
    """Wait until a completion through ``port`` answers 200 (a router may listen before
    its first health check has found the workers); RuntimeError with the last answer."""
    body = json.dumps({"model": model, "prompt": "ready?", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    last = "nothing"
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read()
            if resp.status == 200:
                return
            last = f"HTTP {resp.status}: {text[:200]!r}"
        except OSError as exc:
            last = repr(exc)
        finally:
            conn.close()
        time.sleep(0.2)
    raise RuntimeError(f"port {port} not serving completions after {timeout_s:.0f} s: {last}")
