"""One simulated request as the gateway and a backend see it."""

from __future__ import annotations

from collections.abc import Mapping

from kiloserve.engine.sequence import Sequence
from kiloserve.policies.base import RequestInfo
from kiloserve.sim.prompts import Prompt
from kiloserve.workload import RequestSpec

__all__ = ["DECODE_LEG", "PREFILL_LEG", "WHOLE", "SimRequest"]

# What the current attempt runs (disaggregated prefill/decode, sim.disagg): the whole
# request, a split request's prefill leg (max_tokens 1, blocks held), or its decode leg.
WHOLE = 0
PREFILL_LEG = 1
DECODE_LEG = 2


class SimRequest:
    """A request's journey: gateway decision, attempts, backend-side token times.

    ``ranked`` holds the backends the gateway may try (the decision's ranked list cut
    to ``retries + 1``); ``attempt`` indexes it. A split request (``leg``) runs its
    prefill leg over one such list, then its decode leg over another (``attempt`` starts
    again at 0; ``profile`` keeps the gateway's profile of the whole request, ``held``
    the prefill backend and sequence whose KV the decode leg pulls). Times are
    simulated seconds. A plain
    class, not a dataclass: the compiled build (mypyc) runs a dataclass's generated
    ``__init__`` as interpreted code.
    """

    __slots__ = (
        "arrival_s",
        "attempt",
        "attempt_start_s",
        "cached_blocks",
        "decode_ranked",
        "engine_add_s",
        "first_token_s",
        "gateway_first_token_s",
        "held",
        "info",
        "leg",
        "profile",
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
        self.leg = WHOLE
        self.profile = info  # the whole request's profile (``info`` is per attempt)
        self.held: tuple[int, str] | None = None  # (prefill backend, seq id) holding KV
        self.decode_ranked: tuple[int, ...] = ()  # a split request's decode backends

    @property
    def backend_index(self) -> int:
        return self.ranked[self.attempt]

    @property
    def seq_id(self) -> str:
        rid = self.spec.request_id
        if self.leg == PREFILL_LEG:  # never the id of a later leg on the same engine
            return f"{rid}#p{self.attempt}"
        return rid if self.attempt == 0 else f"{rid}#{self.attempt}"

    @property
    def has_more_attempts(self) -> bool:
        return self.attempt + 1 < len(self.ranked)
