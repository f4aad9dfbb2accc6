"""Fault injection for drills (SPEC S3.6): set at start-up by flags or at run time.

The JSON forms of ``POST /admin/faults`` are a contract; a body (``Content-Type:
application/json``: the server refuses other types, and a foreign ``Host`` or
``Origin``, and wants a bearer token when started with one; ``engine/server.py``)
replaces the whole active set (keys left out are off, so ``{}`` clears every fault)::

    {"slowdown": 4.0}                     every modelled step takes 4x as long
    {"error_rate": 0.5, "status": 500}    half the inference requests answer 500
    {"hang": true}                        inference requests (and /health) never answer
    {"stall_after_tokens": 5}             streams stop after 5 tokens, connection kept open
    {"crash": true}                       the process exits (code 1) after answering 200

``GET /admin/faults`` answers the active set in the same form (``{}`` when none), so
its output can be posted back. Error draws use a ``random.Random`` seeded at start-up,
so a run with the same seed and request order fails the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kiloserve.errors import RequestError

__all__ = ["FaultInjector", "FaultSet"]

MAX_SLOWDOWN = 10_000.0
_KEYS = ("slowdown", "error_rate", "status", "hang", "stall_after_tokens", "crash")


@dataclass(frozen=True, slots=True)
class FaultSet:
    """One set of active faults; the defaults mean 'healthy'."""

    slowdown: float = 1.0
    error_rate: float = 0.0
    error_status: int = 500
    is_hang: bool = False
    stall_after_tokens: int | None = None
    is_crash: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.slowdown <= MAX_SLOWDOWN:
            raise RequestError(
                f"slowdown must be in (0, {MAX_SLOWDOWN:g}], got {self.slowdown}", param="slowdown"
            )
        if not 0.0 <= self.error_rate <= 1.0:
            raise RequestError("error_rate must be within [0, 1]", param="error_rate")
        if not 400 <= self.error_status <= 599:
            raise RequestError("status must be an HTTP error status (400-599)", param="status")
        if self.stall_after_tokens is not None and self.stall_after_tokens < 0:
            raise RequestError("stall_after_tokens must be >= 0", param="stall_after_tokens")

    @classmethod
    def from_json(cls, body: object) -> FaultSet:
        """Parse the ``POST /admin/faults`` body; unknown keys or wrong types are 400s."""
        if not isinstance(body, dict):
            raise RequestError("fault body must be a JSON object")
        unknown = sorted(set(body) - set(_KEYS))
        if unknown:
            raise RequestError(f"unknown fault keys {unknown}; valid keys: {list(_KEYS)}")
        return cls(
            slowdown=_number(body, "slowdown", 1.0),
            error_rate=_number(body, "error_rate", 0.0),
            error_status=_integer(body, "status", 500),
            is_hang=_flag(body, "hang"),
            stall_after_tokens=_opt_integer(body, "stall_after_tokens"),
            is_crash=_flag(body, "crash"),
        )

    def to_json(self) -> dict[str, object]:
        """The active faults in the POST form (healthy values left out)."""
        out: dict[str, object] = {}
        if self.slowdown != 1.0:
            out["slowdown"] = self.slowdown
        if self.error_rate > 0:
            out["error_rate"] = self.error_rate
            out["status"] = self.error_status
        if self.is_hang:
            out["hang"] = True
        if self.stall_after_tokens is not None:
            out["stall_after_tokens"] = self.stall_after_tokens
        return out


def _number(body: dict[str, object], key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number", param=key)
    return float(value)


def _integer(body: dict[str, object], key: str, default: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer", param=key)
    return value


def _opt_integer(body: dict[str, object], key: str) -> int | None:
    return None if body.get(key) is None else _integer(body, key, 0)


def _flag(body: dict[str, object], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", param=key)
    return value


class FaultInjector:
    """The twin's current faults plus the seeded RNG for error draws."""

    def __init__(self, faults: FaultSet | None = None, seed: int = 0) -> None:
        self.faults = faults if faults is not None else FaultSet()
        self._rng = random.Random(seed)

    def replace(self, faults: FaultSet) -> None:
        """Make ``faults`` the active set (the ``POST /admin/faults`` semantics)."""
        self.faults = faults

    @property
    def slowdown(self) -> float:
        return self.faults.slowdown

    def draw_error_status(self) -> int | None:
        """The status to fail this request with, or ``None`` to serve it."""
        rate = self.faults.error_rate
        if rate <= 0.0:
            return None
        return self.faults.error_status if self._rng.random() < rate else None
