"""Child processes for the local cluster: start, wait until healthy, watch, stop.

Each child runs in its own session (process group) so that stopping it also stops
anything it started; output goes to a log file per child.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiloserve.errors import LaunchError

__all__ = ["ChildProcess", "tail"]

log = logging.getLogger(__name__)

#: How long ``ChildProcess.stop`` waits for a SIGKILLed child to be gone.
KILL_WAIT_S = 30.0


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (Linux), so a
    hard-killed ``kiloserve up`` or test run leaves no engine behind."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def tail(path: Path, num_lines: int = 15) -> str:
    """The last lines of a log file (empty string if unreadable)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


@dataclass
class ChildProcess:
    """One supervised child: argv, the URL it serves and its log file."""

    name: str
    argv: Sequence[str]
    url: str
    log_path: Path
    env: Mapping[str, str] | None = None
    health_path: str = "/health"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    reported_exit: bool = False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env or {})
        with self.log_path.open("ab") as logf:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.debug("started %s pid=%s: %s", self.name, self.proc.pid, " ".join(self.argv))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        """None while running (or never started), else the exit status."""
        return self.proc.poll() if self.proc else None

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=timeout_s) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until ``/health`` answers 200; raise LaunchError on exit or time-out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise LaunchError(
                    f"{self.name} exited with status {code} while starting; "
                    f"last log lines ({self.log_path}):\n{tail(self.log_path)}"
                )
            if self.is_healthy():
                return
            time.sleep(0.1)
        raise LaunchError(
            f"{self.name} did not become healthy at {self.url}{self.health_path} within "
            f"{timeout_s:.0f} s; last log lines ({self.log_path}):\n{tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 5.0, kill_wait_s: float = KILL_WAIT_S) -> None:
        """SIGTERM the child's process group, then SIGKILL after ``grace_s``; wait up to
        ``kill_wait_s`` for a killed child to be gone (a starved box can take seconds to
        tear down a large process) and raise ``subprocess.TimeoutExpired`` only then."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # the child itself, should it have left its group
            self.proc.wait(timeout=kill_wait_s)
        # Anything the child left behind in its session goes too.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
