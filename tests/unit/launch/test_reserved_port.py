"""``reserved_port``: a free port outside the kernel's ephemeral range (launch/engines.py)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from kiloserve.launch import engines
from kiloserve.launch.engines import reserved_port


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = (
            int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        )
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def test_ports_are_free_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral()
    for seed in range(20):
        port = reserved_port("127.0.0.1", random.Random(seed))
        assert not low <= port <= high, port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free: binds


def test_a_taken_port_is_skipped() -> None:
    first = reserved_port("127.0.0.1", random.Random(7))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        again = reserved_port("127.0.0.1", random.Random(7))  # same first draw: taken
    assert again != first


def test_the_nixl_side_channel_uses_it() -> None:
    env = engines._nixl_side_channel("127.0.0.1")
    low, high = _ephemeral()
    assert not low <= int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) <= high
