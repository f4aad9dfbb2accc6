"""The ``Router``: one request's routing life, the same in the gateway and the simulator.

    decide -> dispatch -> first_token -> complete (-> Outcome)

* ``decide`` asks the policy once (``choose`` on a snapshot of the table), keeps the
  backends of the request's model pool that are routable, in the policy's order, and
  passes them through the optional ``admit`` hook (the gateway's circuit-breaker trial,
  ``gateway/resilience``). A caller that needs a ranking for admission uses this one
  decision and hands it on; nothing decides twice.
* ``dispatch`` / ``first_token`` / ``complete`` update the table's live counters, then
  the policy's hooks, then the listeners (health, dashboard, usage), in that order, so
  every consumer of a completion hears of it from one place.
* ``complete`` turns what was measured of one attempt (start, first token, last
  token, number of output tokens) into the ``Outcome`` every consumer reads. A
  non-streamed success has no first token; its TTFT is estimated
  (``accounting.estimated_ttft_ms``, from ``last_token_s``: when the response ended)
  and noted in the table before the completion, so the learned prefill speed covers
  non-streamed traffic. The ``Outcome`` and the listeners keep what was measured.

Times are plain floats in seconds from the caller's clock (the event loop's in the
gateway, simulated time in the simulator); the router reads no clock of its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from kiloserve.errors import NotFoundError
from kiloserve.policies.accounting import estimated_ttft_ms
from kiloserve.policies.base import BackendState, Decision, Outcome, Policy, RequestInfo
from kiloserve.routing.disagg import Role, unsplit_order
from kiloserve.routing.table import BackendTable

__all__ = [
    "AdmitHook",
    "CompletionListener",
    "DecisionListener",
    "FirstTokenListener",
    "Router",
    "outcome_of",
]

AdmitHook = Callable[[tuple[str, ...], frozenset[str]], tuple[str, ...]]
DecisionListener = Callable[[RequestInfo, Decision, tuple[str, ...]], None]
FirstTokenListener = Callable[[str, RequestInfo, float], None]
CompletionListener = Callable[[str, RequestInfo, Outcome], None]


def outcome_of(
    ok: bool,
    status: int,
    started_s: float,
    first_token_s: float | None,
    last_token_s: float,
    output_tokens: int,
) -> Outcome:
    """One attempt's ``Outcome``: TTFT from start to first token, TPOT over the tokens
    after the first (``None`` when there was no first token, or one token only)."""
    ttft_ms = tpot_ms = None
    if first_token_s is not None:
        ttft_ms = (first_token_s - started_s) * 1000.0
        if output_tokens > 1:
            tpot_ms = (last_token_s - first_token_s) / (output_tokens - 1) * 1000.0
    return Outcome(ok, status, ttft_ms, tpot_ms, output_tokens)


class Router:
    """Decisions and their bookkeeping over one ``BackendTable`` with one policy."""

    def __init__(
        self,
        table: BackendTable,
        policy: Policy,
        rng: random.Random,
        *,
        admit: AdmitHook | None = None,
        block_size: int = 16,
    ) -> None:
        self.table = table
        self.block_size = block_size  # the gateway's prefix block (cached-token counts)
        self.policy = policy
        self.rng = rng
        self.admit = admit
        self.decision_listeners: list[DecisionListener] = []
        # run before every decision, after the table's sync (the gateway's workers:
        # the siblings' prefix placements, routing/shared_prefixes.py)
        self.before_decide: Callable[[], None] | None = None
        self.first_token_listeners: list[FirstTokenListener] = []
        self.completion_listeners: list[CompletionListener] = []
        # request id -> the backend that must rank first when routable and in the pool (a
        # Responses API follow-up goes where its previous response is; gateway/extra_apis.py)
        self.pins: dict[str, str] = {}

    @property
    def policy_name(self) -> str:
        return self.policy.name

    def decide(
        self,
        info: RequestInfo,
        now_s: float,
        *,
        eligible_by_model: dict[str, tuple[BackendState, ...]] | None = None,
        limit: int | None = None,
        role: Role | None = None,
    ) -> Decision:
        """The policy's ranking restricted to the model's routable pool, best first.

        ``limit`` stops once that many backends are found (the simulator asks for the
        proxy's ``retries + 1``); ``eligible_by_model`` is handed to the snapshot (see
        ``BackendTable.snapshot``). The returned ``Decision`` may be empty.

        Disaggregated serving (``routing/disagg.py``): with ``role`` the policy chooses
        among that role's backends only (a split request's prefill leg); without it, in
        a table with prefill/decode-role backends, the ranking puts ``both`` backends
        first, then ``decode``, then ``prefill`` ones (``unsplit_order``).
        """
        table = self.table
        table.sync()
        if self.before_decide is not None:
            self.before_decide()
        pool = table.pool_ids(info.model)
        if role is not None:
            eligible_by_model, pool = self._of_role(info.model, role, eligible_by_model)
        snapshot = table.snapshot(now_s, eligible_by_model)
        decision = self.policy.choose(info, snapshot, self.rng)
        order = decision.ranked
        if role is None and table.has_roles:
            order = unsplit_order(order, table.role_of)
        ranked: list[str] = []
        pin = self.pins.get(info.request_id) if self.pins else None
        if pin is not None and pin in pool and table.is_routable(pin):
            ranked.append(pin)
        for backend_id in order:
            if len(ranked) == limit:
                break
            if backend_id != pin and backend_id in pool and table.is_routable(backend_id):
                ranked.append(backend_id)
        kept = tuple(ranked)
        if self.admit is not None:
            kept = self.admit(kept, pool)
        if kept and self.decision_listeners:
            for listener in self.decision_listeners:
                listener(info, decision, kept)
        return decision.with_ranked(kept)

    def continuation(self, ranked: tuple[str, ...], failed: set[str]) -> str | None:
        """Where a cut stream goes on: the first of the decision's ``ranked`` backends
        not in ``failed`` that is routable now; when none is, what a new decision would
        get over those same backends from the ``admit`` hook (panic routing when every
        one of them only failed its probes: an overloaded box's probes time out while
        its requests are served, and a continuation trusts traffic as a decision does)."""
        table = self.table
        for backend_id in ranked:
            if backend_id not in failed and table.is_routable(backend_id):
                return backend_id
        if self.admit is None:
            return None
        rest = frozenset(
            b for b in ranked if b not in failed and table.record_or_none(b) is not None
        )
        return next(iter(self.admit((), rest)), None) if rest else None

    def _of_role(
        self, model: str, role: Role, eligible_by_model: dict[str, tuple[BackendState, ...]] | None
    ) -> tuple[dict[str, tuple[BackendState, ...]], frozenset[str]]:
        """(the policy's candidates, the pool) restricted to ``role``'s backends."""
        given = None if eligible_by_model is None else eligible_by_model.get(model)
        source = given if given is not None else self.table.pool(model)
        states = tuple(b for b in source if b.role == role and b.is_routable and b.weight > 0.0)
        ids = frozenset(b.backend_id for b in self.table.pool(model) if b.role == role)
        return {**(eligible_by_model or {}), model: states}, ids

    def cached_tokens(
        self, info: RequestInfo, cached_blocks: Mapping[str, int] | None, backend_id: str
    ) -> int | None:
        """The prompt tokens a decision's ``cached_blocks`` expect cached on
        ``backend_id``: whole blocks, at most all but the last prompt token (vLLM always
        computes one); None when the policy did not look."""
        if cached_blocks is None:
            return None
        size, num_tokens = self.block_size, info.input_tokens
        most = (num_tokens - 1) // size * size if num_tokens > 0 else 0
        return min(cached_blocks.get(backend_id, 0) * size, most)

    def attempt_info(
        self, info: RequestInfo, cached_blocks: Mapping[str, int] | None, backend_id: str
    ) -> RequestInfo:
        """``info`` for one attempt on ``backend_id``: with the tokens expected cached
        there (``RequestInfo.cached_tokens``), so the outstanding prefill work counts
        only what the engine must compute. Pass it to ``dispatch``, ``first_token`` and
        ``complete`` of that attempt."""
        cached = self.cached_tokens(info, cached_blocks, backend_id) or 0
        return info if cached == info.cached_tokens else info.replaced(cached_tokens=cached)

    def dispatch(self, backend_id: str, info: RequestInfo) -> None:
        """An attempt is sent to ``backend_id``."""
        self.table.on_dispatch(backend_id, info)
        self.policy.on_dispatch(info, backend_id)

    def first_token(self, backend_id: str, info: RequestInfo, ttft_ms: float) -> None:
        """The attempt's first output token reached the gateway, ``ttft_ms`` after dispatch."""
        self.table.on_first_token(backend_id, info, ttft_ms)
        for listener in self.first_token_listeners:
            listener(backend_id, info, ttft_ms)

    def complete(
        self,
        backend_id: str,
        info: RequestInfo,
        *,
        ok: bool,
        status: int,
        started_s: float,
        first_token_s: float | None,
        last_token_s: float,
        output_tokens: int,
    ) -> Outcome:
        """The attempt ended (``status`` 499: the client left); tell everyone once."""
        outcome = outcome_of(ok, status, started_s, first_token_s, last_token_s, output_tokens)
        had_first = first_token_s is not None
        if not had_first and ok:
            e2e_ms = (last_token_s - started_s) * 1000.0
            had_first = self._learn_ttft(backend_id, info, e2e_ms, output_tokens)
        self.table.on_complete(backend_id, info, outcome, had_first_token=had_first)
        self.policy.on_complete(info, backend_id, outcome)
        for listener in self.completion_listeners:
            listener(backend_id, info, outcome)
        return outcome

    def _learn_ttft(
        self, backend_id: str, info: RequestInfo, e2e_ms: float, output_tokens: int
    ) -> bool:
        """Note the estimated TTFT of a non-streamed success; True when there was one."""
        try:
            state = self.table.state(backend_id)
        except NotFoundError:  # removed from the table meanwhile (registry)
            return False
        ttft_ms = estimated_ttft_ms(state, e2e_ms, output_tokens)
        if ttft_ms is None:
            return False
        self.table.on_first_token(backend_id, info, ttft_ms)
        return True
