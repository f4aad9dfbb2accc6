"""One simulated request as the gateway and a backend see it."""

from __future__ import annotations

from collections.abc import Mapping

from kiloserve.engine.sequence import Sequence
from kiloserve.policies.base import RequestInfo
from kiloserve.sim.prompts import Prompt
from kiloserve.workload import RequestSpec

__all__ = ["SimRequest"]


class SimRequest:
    """A request's journey: gateway decision, attempts, backend-side token times.

    ``ranked`` holds the backends the gateway may try (the decision's ranked list cut
    to ``retries + 1``); ``attempt`` indexes it. Times are simulated seconds. A plain
    class, not a dataclass: the compiled build (mypyc) runs a dataclass's generated
    ``__init__`` as interpreted code.
    """

    __slots__ = (
        "arrival_s",
        "attempt",
        "attempt_start_s",
        "cached_blocks",
        "engine_add_s",
        "first_token_s",
        "gateway_first_token_s",
        "info",
        "prompt",
        "queue_s",
        "ranked",
        "seq",
        "spec",
    )

    def __init__(
        self,
        spec: RequestSpec,
        info: RequestInfo,
        prompt: Prompt,
        arrival_s: float,
        *,
        seq: Sequence | None = None,
    ) -> None:
        self.spec = spec
        self.info = info
        self.prompt = prompt
        self.arrival_s = arrival_s
        self.ranked: tuple[int, ...] = ()
        self.cached_blocks: Mapping[str, int] | None = None  # the decision's prefix matches
        self.attempt = 0
        self.attempt_start_s = 0.0
        self.seq = seq
        self.first_token_s: float | None = None  # backend side, current attempt
        self.engine_add_s = 0.0  # when the current attempt reached its engine
        self.queue_s: float | None = None  # engine queue time, current attempt
        self.gateway_first_token_s: float | None = None  # current attempt, at the gateway

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
