"""A cross-process lock on a file (``flock``), for the gateway's worker processes."""

from __future__ import annotations

import fcntl
import os

__all__ = ["FileLock"]


class FileLock:
    """A cross-process lock on a file (``flock``): released by the kernel when its
    holder dies, so a crashed worker never leaves it taken."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> FileLock:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)
