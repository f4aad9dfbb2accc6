"""Shared test helpers: free ports on 127.0.0.1 and a path to the shared data folder."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


class FixedStepTimer:
    """A modelled GPU whose every step takes ``step_s`` (token spacing known exactly)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def step_time_s(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        return self.step_s

    def decode_steps_time_s(self, num_seqs: int, context_tokens: int, num_steps: int) -> float:
        return self.step_s * num_steps


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()
