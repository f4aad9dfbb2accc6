"""One simulated request as the gateway and a backend see it."""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.engine.sequence import Sequence
from kiloserve.policies.base import RequestInfo
from kiloserve.sim.prompts import Prompt
from kiloserve.workload import RequestSpec

__all__ = ["SimRequest"]


@dataclass(slots=True, eq=False)
class SimRequest:
    """A request's journey: gateway decision, attempts, backend-side token times.

    ``ranked`` holds the backends the gateway may try (the decision's ranked list cut
    to ``retries + 1``); ``attempt`` indexes it. Times are simulated seconds.
    """

    spec: RequestSpec
    info: RequestInfo
    prompt: Prompt
    arrival_s: float
    ranked: tuple[int, ...] = ()
    attempt: int = 0
    attempt_start_s: float = 0.0
    seq: Sequence | None = None
    first_token_s: float | None = None  # backend side, current attempt
    gateway_first_token_s: float | None = None  # current attempt, at the gateway

    @property
    def backend_index(self) -> int:
        return self.ranked[self.attempt]

    @property
    def seq_id(self) -> str:
        rid = self.spec.request_id
        return rid if self.attempt == 0 else f"{rid}#{self.attempt}"

    @property
    def has_more_attempts(self) -> bool:
        return self.attempt + 1 < len(self.ranked)
