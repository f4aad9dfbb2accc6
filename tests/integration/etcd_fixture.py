"""A real etcd (Debian's ``etcd-server``) on 127.0.0.1 with free ports and a temp data dir:
the chaos drill's ``LocalEtcd``, skipping the test when etcd is not installed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiloserve.chaos.etcd import LocalEtcd

__all__ = ["EtcdProcess", "etcd_binary"]


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        pytest.skip("etcd not installed (scripts/ensure_tools.sh installs Debian's etcd-server)")
    return path


class EtcdProcess(LocalEtcd):
    """Start / stop / restart one etcd member; ``endpoint`` is HOST:PORT."""

    def __init__(self, data_dir: Path) -> None:
        etcd_binary()  # a skip, not LocalEtcd's ConfigError, when etcd is missing
        super().__init__(data_dir)
