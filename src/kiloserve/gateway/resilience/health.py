"""Active health checks (SPEC S3.1), the pure half: the ``health:`` config and the
verdict state machine. The probe loops themselves (I/O) are in ``prober.py``.

``unhealthy_threshold`` consecutive failures mark a backend unhealthy,
``healthy_threshold`` consecutive successes healthy again (``ProbeTracker``, pure). The
next probe starts ``interval_s`` x (1 +- ``jitter``) after the previous one started;
after a failure that has not yet tipped the backend over, the confirming probe comes
after ``recheck_interval_s`` instead, so a hang is found within one interval plus the
confirmations.

The completion probe (``completion_probe``, on by default for vLLM and SGLang) catches
an engine whose ``/health`` answers while its inference hangs or fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["COMPLETION_PROBE_ENGINES", "HealthConfig", "ProbeTracker", "wants_completion_probe"]

# engines that batch continuously: a 1-token probe costs them one decode slot for a
# step, never a whole slot of a few (llama.cpp's --parallel) as it would elsewhere
COMPLETION_PROBE_ENGINES = frozenset({"vllm", "sglang"})


class HealthConfig(BaseModel):
    """``health:`` section of the gateway config (active probes)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    interval_s: float = Field(default=5.0, gt=0.0)
    jitter: float = Field(default=0.1, ge=0.0, lt=1.0)
    recheck_interval_s: float = Field(default=1.0, gt=0.0)
    timeout_s: float = Field(default=1.0, gt=0.0)
    unhealthy_threshold: int = Field(default=2, ge=1)
    healthy_threshold: int = Field(default=2, ge=1)
    path: str = "/health"
    # a real 1-token completion after /health: "auto" = for vLLM (the twin) and SGLang
    completion_probe: bool | Literal["auto"] = "auto"
    completion_timeout_s: float = Field(default=10.0, gt=0.0)


def wants_completion_probe(setting: bool | Literal["auto"], engine: str | None) -> bool:
    """Whether a backend of ``engine`` (from its scrape, or the config's ``engine:``)
    gets the completion probe under ``setting``."""
    if setting == "auto":
        return engine in COMPLETION_PROBE_ENGINES
    return bool(setting)


@dataclass(slots=True)
class _Streak:
    num_failures: int = 0
    num_successes: int = 0
    is_healthy: bool = True


class ProbeTracker:
    """Consecutive probe results per backend -> healthy / unhealthy (pure)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self._streaks: dict[str, _Streak] = {}

    def is_healthy(self, backend_id: str) -> bool:
        streak = self._streaks.get(backend_id)
        return streak is None or streak.is_healthy

    def forget(self, backend_id: str) -> None:
        self._streaks.pop(backend_id, None)

    def record(self, backend_id: str, is_ok: bool) -> bool | None:
        """Record one probe; returns the new health when it changed, else None."""
        s = self._streaks.setdefault(backend_id, _Streak())
        if is_ok:
            s.num_failures, s.num_successes = 0, s.num_successes + 1
            if not s.is_healthy and s.num_successes >= self.cfg.healthy_threshold:
                s.is_healthy = True
                return True
            return None
        s.num_successes, s.num_failures = 0, s.num_failures + 1
        if s.is_healthy and s.num_failures >= self.cfg.unhealthy_threshold:
            s.is_healthy = False
            return False
        return None

    def is_confirming(self, backend_id: str) -> bool:
        """True after a failure that has not (yet) changed the verdict."""
        s = self._streaks.get(backend_id)
        return s is not None and s.is_healthy and s.num_failures > 0
