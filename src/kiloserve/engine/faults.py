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
    {"thermal": {"throttle_at_c": 83, "factor": 2.0}}
                                          thermal throttling (S3.7): see ``ThermalFault``
    {"pcie_saturation": 0.9}              other traffic fills 90% of the PCIe link
    {"nvlink_degrade_at_c": 75}           NVLink at half width while >= 75 C (seed 004)
    {"xid": 79}                           the GPU reports Xid 79 (an Xid burst)
    {"ecc_dbe_errors": 2}                 2 volatile double-bit (uncorrectable) ECC errors

The last four move only the twin's node page (``GET /node/metrics``,
``engine/node_metrics.py``: what a dcgm-exporter beside the engine would report).

``GET /admin/faults`` answers the active set in the same form (``{}`` when none), so
its output can be posted back. Error draws use a ``random.Random`` seeded at start-up,
so a run with the same seed and request order fails the same requests.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from kiloserve.errors import RequestError

__all__ = ["FaultInjector", "FaultSet", "ThermalFault", "ThermalModel"]

MAX_SLOWDOWN = 10_000.0
_KEYS = (
    "slowdown", "error_rate", "status", "hang", "stall_after_tokens", "crash", "thermal",
    "pcie_saturation", "nvlink_degrade_at_c", "xid", "ecc_dbe_errors",
)  # fmt: skip
_THERMAL_KEYS = (
    "throttle_at_c", "resume_at_c", "factor", "ambient_c", "load_c", "time_constant_s",
)  # fmt: skip
MAX_TEMPERATURE_C = 200.0


@dataclass(frozen=True, slots=True)
class ThermalFault:
    """A GPU that throttles its clock when hot (a failed fan, blocked airflow).

    First-order model: the temperature relaxes toward ``ambient_c + u * (load_c -
    ambient_c)`` with time constant ``time_constant_s``, where ``u`` is the busy share
    of wall time (1 while stepping, 0 while idle). At or above ``throttle_at_c`` the
    clock drops to ``1 / factor`` (every step takes ``factor`` x as long, on top of
    ``slowdown``) until the temperature falls below ``resume_at_c`` (hysteresis).
    ``load_c`` must exceed ``throttle_at_c`` or full load never throttles.
    """

    throttle_at_c: float = 83.0
    resume_at_c: float | None = None  # None: throttle_at_c - 5
    factor: float = 2.0
    ambient_c: float = 40.0
    load_c: float = 90.0
    time_constant_s: float = 60.0

    def __post_init__(self) -> None:
        for key in ("throttle_at_c", "ambient_c", "load_c"):
            value = getattr(self, key)
            if not -50.0 <= value <= MAX_TEMPERATURE_C:
                raise RequestError(f"thermal.{key} must be within [-50, 200] C", param=key)
        if self.resume_at_c is not None and not (
            self.ambient_c < self.resume_at_c <= self.throttle_at_c
        ):
            raise RequestError(
                "thermal.resume_at_c must be in (ambient_c, throttle_at_c]", param="resume_at_c"
            )
        if self.throttle_at_c <= self.ambient_c:
            raise RequestError("thermal.throttle_at_c must exceed ambient_c", param="throttle_at_c")
        if self.load_c < self.ambient_c:
            raise RequestError("thermal.load_c must be >= ambient_c", param="load_c")
        if not 1.0 <= self.factor <= MAX_SLOWDOWN:
            raise RequestError(f"thermal.factor must be in [1, {MAX_SLOWDOWN:g}]", param="factor")
        if not 0.0 < self.time_constant_s <= 86_400.0:
            raise RequestError(
                "thermal.time_constant_s must be in (0, 86400]", param="time_constant_s"
            )

    @property
    def resume_c(self) -> float:
        """The temperature the clock recovers below (``resume_at_c`` or 5 C under)."""
        if self.resume_at_c is not None:
            return self.resume_at_c
        return max(self.throttle_at_c - 5.0, (self.throttle_at_c + self.ambient_c) / 2)

    @classmethod
    def from_json(cls, body: object) -> ThermalFault:
        if not isinstance(body, dict):
            raise RequestError("'thermal' must be a JSON object", param="thermal")
        unknown = sorted(set(body) - set(_THERMAL_KEYS))
        if unknown:
            raise RequestError(
                f"unknown thermal keys {unknown}; valid keys: {list(_THERMAL_KEYS)}",
                param="thermal",
            )
        d = cls()
        resume = body.get("resume_at_c")
        return cls(
            throttle_at_c=_number(body, "throttle_at_c", d.throttle_at_c),
            resume_at_c=None if resume is None else _number(body, "resume_at_c", 0.0),
            factor=_number(body, "factor", d.factor),
            ambient_c=_number(body, "ambient_c", d.ambient_c),
            load_c=_number(body, "load_c", d.load_c),
            time_constant_s=_number(body, "time_constant_s", d.time_constant_s),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "throttle_at_c": self.throttle_at_c,
            "resume_at_c": self.resume_c,
            "factor": self.factor,
            "ambient_c": self.ambient_c,
            "load_c": self.load_c,
            "time_constant_s": self.time_constant_s,
        }


class ThermalModel:
    """The modelled temperature and throttle state of one GPU (pure: time is passed in).

    ``busy(start_s, end_s)`` records a step (the GPU at full load); time between the
    last update and ``start_s`` counts as idle. ``advance(now_s)`` lets it cool to
    ``now_s`` (idle). Within one segment the temperature moves monotonically, so the
    hysteresis is checked at segment ends.
    """

    def __init__(self, fault: ThermalFault, now_s: float, temperature_c: float | None = None):
        self.fault = fault
        self.temperature_c = fault.ambient_c if temperature_c is None else temperature_c
        self.is_throttled = False
        self._last_s = now_s
        self._update_throttle()

    @property
    def clock_ratio(self) -> float:
        """Clock as a share of full speed (1 / factor while throttled)."""
        return 1.0 / self.fault.factor if self.is_throttled else 1.0

    @property
    def step_factor(self) -> float:
        """How much longer a step takes at the current clock."""
        return self.fault.factor if self.is_throttled else 1.0

    def advance(self, now_s: float) -> None:
        """Idle (cooling toward ambient) from the last update until ``now_s``."""
        self._segment(now_s, 0.0)

    def busy(self, start_s: float, end_s: float) -> None:
        """Full load over ``[start_s, end_s]``, idle before it since the last update."""
        self._segment(start_s, 0.0)
        self._segment(end_s, 1.0)

    def _segment(self, end_s: float, utilisation: float) -> None:
        dt = end_s - self._last_s
        if dt <= 0:
            return
        f = self.fault
        target = f.ambient_c + utilisation * (f.load_c - f.ambient_c)
        decay = math.exp(-dt / f.time_constant_s)
        self.temperature_c = target + (self.temperature_c - target) * decay
        self._last_s = end_s
        self._update_throttle()

    def _update_throttle(self) -> None:
        if self.temperature_c >= self.fault.throttle_at_c:
            self.is_throttled = True
        elif self.temperature_c < self.fault.resume_c:
            self.is_throttled = False


@dataclass(frozen=True, slots=True)
class FaultSet:
    """One set of active faults; the defaults mean 'healthy'."""

    slowdown: float = 1.0
    error_rate: float = 0.0
    error_status: int = 500
    is_hang: bool = False
    stall_after_tokens: int | None = None
    is_crash: bool = False
    thermal: ThermalFault | None = None
    pcie_saturation: float = 0.0  # share of the PCIe link other traffic takes
    nvlink_degrade_at_c: float | None = None  # NVLink at half width at or above this
    xid: int = 0  # the last Xid the GPU reports (0: none)
    ecc_dbe_errors: int = 0  # volatile double-bit ECC errors

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
        self._check_node_faults()

    def _check_node_faults(self) -> None:
        if not 0.0 <= self.pcie_saturation <= 1.0:
            raise RequestError("pcie_saturation must be within [0, 1]", param="pcie_saturation")
        degrade_c = self.nvlink_degrade_at_c
        if degrade_c is not None and not -50.0 <= degrade_c <= MAX_TEMPERATURE_C:
            raise RequestError(
                "nvlink_degrade_at_c must be within [-50, 200] C", param="nvlink_degrade_at_c"
            )
        if not 0 <= self.xid <= 65_535:
            raise RequestError("xid must be an Xid code in [0, 65535] (0: none)", param="xid")
        if self.ecc_dbe_errors < 0:
            raise RequestError("ecc_dbe_errors must be >= 0", param="ecc_dbe_errors")

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
            thermal=_opt_thermal(body),
            pcie_saturation=_number(body, "pcie_saturation", 0.0),
            nvlink_degrade_at_c=_opt_number(body, "nvlink_degrade_at_c"),
            xid=_integer(body, "xid", 0),
            ecc_dbe_errors=_integer(body, "ecc_dbe_errors", 0),
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
        if self.thermal is not None:
            out["thermal"] = self.thermal.to_json()
        node: dict[str, object] = {
            "pcie_saturation": self.pcie_saturation,
            "nvlink_degrade_at_c": self.nvlink_degrade_at_c,
            "xid": self.xid,
            "ecc_dbe_errors": self.ecc_dbe_errors,
        }
        out.update((k, v) for k, v in node.items() if v)
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


def _opt_number(body: dict[str, object], key: str) -> float | None:
    return None if body.get(key) is None else _number(body, key, 0.0)


def _opt_integer(body: dict[str, object], key: str) -> int | None:
    return None if body.get(key) is None else _integer(body, key, 0)


def _opt_thermal(body: dict[str, object]) -> ThermalFault | None:
    value = body.get("thermal")
    return None if value is None else ThermalFault.from_json(value)


def _flag(body: dict[str, object], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean", param=key)
    return value


class FaultInjector:
    """The twin's current faults, the seeded RNG for error draws, the thermal state.

    ``clock`` must be the twin loop's clock (the thermal model is stepped with its
    times and read at scrape time).
    """

    def __init__(
        self,
        faults: FaultSet | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rng = random.Random(seed)
        self._clock = clock
        self.faults = FaultSet()
        self.thermal: ThermalModel | None = None
        self.busy_s_total = 0.0  # modelled GPU busy time (the node page's utilisation)
        self.replace(faults if faults is not None else FaultSet())

    def replace(self, faults: FaultSet) -> None:
        """Make ``faults`` the active set (the ``POST /admin/faults`` semantics).

        A thermal fault that stays set keeps its current temperature (new constants
        apply from now); one newly set starts at its ambient temperature.
        """
        self.faults = faults
        if faults.thermal is None:
            self.thermal = None
        elif self.thermal is None:
            self.thermal = ThermalModel(faults.thermal, self._clock())
        else:
            now_s = self._clock()
            self.thermal.advance(now_s)
            self.thermal = ThermalModel(faults.thermal, now_s, self.thermal.temperature_c)

    @property
    def slowdown(self) -> float:
        """The step-time multiplier now: ``slowdown`` x the thermal clock drop."""
        thermal = self.thermal
        return self.faults.slowdown * (1.0 if thermal is None else thermal.step_factor)

    def on_step(self, start_s: float, end_s: float) -> None:
        """The twin loop stepped (GPU busy) over ``[start_s, end_s]``."""
        self.busy_s_total += max(0.0, end_s - start_s)
        if self.thermal is not None:
            self.thermal.busy(start_s, end_s)

    def thermal_reading(self) -> tuple[float | None, float]:
        """(modelled temperature in C or ``None`` without the fault, clock ratio)."""
        thermal = self.thermal
        if thermal is None:
            return None, 1.0
        thermal.advance(self._clock())
        return thermal.temperature_c, thermal.clock_ratio

    def draw_error_status(self) -> int | None:
        """The status to fail this request with, or ``None`` to serve it."""
        rate = self.faults.error_rate
        if rate <= 0.0:
            return None
        return self.faults.error_status if self._rng.random() < rate else None
