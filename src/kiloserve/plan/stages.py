"""The five growth stages (SPEC S4.7, seed 000): 1 card -> 4 -> 32 -> 256 -> 1,024.

For each stage's card count the planner picks the cheapest fitting candidate (per
request at the load it sustains) whose TP fits in that many cards, from the same
memory ledgers and per-replica capacities as the plan. The stage's load is what the
cards sustain: ``replicas x per-replica capacity / headroom``. The simulated cluster
at that load (``kiloserve.plan.pareto.simulate_deployment``) gives the P50/P95
targets and the indicators; the must-dos follow from the numbers, each with its
reason (rules below, thresholds named):

* always: the deployment (GPU, TP, quantisation) and the ledger line that forces it;
  the in-flight requests per replica (Little's law on the run) against what the KV
  cache holds.
* TP > 1: keep the TP group inside one node (all-reduces every layer, every step).
* >= 2 replicas: a gateway with load-aware routing, probes and ejection; the spread
  of utilisation across backends is the key indicator.
* >= ``DEMOTION_MIN_REPLICAS`` (3) replicas: slow-node demotion (its pool yardstick
  needs others to compare with).
* more than one node (``GPUS_PER_NODE`` = 8): the etcd registry and node agents, and
  two gateways behind an L4 balancer (one gateway is a single point of failure).
* gateway CPU (``GATEWAY_CPU_US_PER_REQUEST`` + ``GATEWAY_CPU_US_PER_CHUNK`` per
  streamed token, measured in docs/gateway.md) over ``MAX_CORE_SHARE`` of a core:
  ``--workers``.
* measured prefix-cache hit rate >= ``MIN_PREFIX_HIT_RATE`` with >= 2 replicas:
  prefix-aware routing (otherwise spreading sessions divides the hits).
* TTFT P99 / P50 >= ``ADMISSION_TAIL_RATIO`` in the run: gateway admission (requests
  queue behind others in the engines).
* >= ``PARETO_MIN_CARDS`` (256) cards: a Pareto analysis every +128 cards; $/request
  against the previous stage is the indicator.

The seed's own targets travel along (``SEED_TARGETS``) for comparison only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiloserve.catalog import GIB
from kiloserve.plan.capacity import CapacityResult
from kiloserve.plan.planner import Candidate, cost_per_request

__all__ = [
    "SEED_TARGETS",
    "STAGE_CARDS",
    "Stage",
    "StageChoice",
    "StageItem",
    "build_stage",
    "choose_for_stage",
    "gateway_cores",
    "indicators",
    "must_dos",
    "targets",
]

STAGE_CARDS: tuple[int, ...] = (1, 4, 32, 256, 1024)
SEED_TARGETS: Mapping[int, str] = {
    1: "P50 < 500 ms",
    4: "P50 < 300 ms",
    32: "P95 < 200 ms, GPU-utilisation std-dev < 15%",
    256: "P95 < 150 ms, KV utilisation > 85%, small-request P95 < 100 ms",
    1024: "P95 < 140 ms",
}
GPUS_PER_NODE = 8
DEMOTION_MIN_REPLICAS = 3
GATEWAY_CPU_US_PER_REQUEST = 275.0  # docs/gateway.md "Hot path": default policy, c=32
GATEWAY_CPU_US_PER_CHUNK = 29.0  # same table: per relayed streamed chunk (one token)
MAX_CORE_SHARE = 0.5  # one gateway process kept under half a core of proxy work
MIN_PREFIX_HIT_RATE = 0.05
ADMISSION_TAIL_RATIO = 3.0
PARETO_MIN_CARDS = 256
PARETO_STEP_CARDS = 128


@dataclass(frozen=True, slots=True)
class StageItem:
    """A must-do or an indicator: what, its value where it has one, and why."""

    text: str
    reason: str
    value: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "reason": self.reason}
        return out if self.value is None else out | {"value": self.value}


@dataclass(frozen=True, slots=True)
class StageChoice:
    """The candidate a stage runs, its capacity, and the load its cards sustain."""

    candidate: Candidate
    capacity: CapacityResult
    num_replicas: int
    rate_rps: float
    cost_per_hour: float

    @property
    def cost_per_request(self) -> float:
        return cost_per_request(self.cost_per_hour, self.rate_rps)


@dataclass(slots=True)
class Stage:
    """One growth stage: cards, what runs, measured targets, must-dos, indicators."""

    index: int
    num_cards: int
    choice: StageChoice | None
    targets_ms: dict[str, float | None] = field(default_factory=dict)
    must_dos: list[StageItem] = field(default_factory=list)
    indicators: list[StageItem] = field(default_factory=list)
    not_needed: list[StageItem] = field(default_factory=list)
    is_slo_met: bool | None = None

    @property
    def seed_target(self) -> str:
        return SEED_TARGETS.get(self.num_cards, "")

    def to_dict(self) -> dict[str, Any]:
        c = self.choice
        deployment = None
        if c is not None:
            deployment = {
                "gpu": c.candidate.gpu.name,
                "tp": c.candidate.tp,
                "quant": c.candidate.quant,
                "num_replicas": c.num_replicas,
                "per_replica_rps": c.capacity.rate_rps,
                "cost_per_hour": c.cost_per_hour,
                "cost_per_request": c.cost_per_request,
            }
        return {
            "stage": self.index,
            "num_cards": self.num_cards,
            "deployment": deployment,
            "rate_rps": c.rate_rps if c is not None else None,
            "requests_per_day": c.rate_rps * 86_400.0 if c is not None else None,
            "targets_ms": self.targets_ms,
            "is_slo_met": self.is_slo_met,
            "must_dos": [m.to_dict() for m in self.must_dos],
            "indicators": [i.to_dict() for i in self.indicators],
            "not_needed": [n.to_dict() for n in self.not_needed],
            "seed_target": self.seed_target,
        }


def choose_for_stage(
    num_cards: int,
    candidates: Sequence[Candidate],
    capacities: Mapping[str, CapacityResult],
    prices: Callable[[Candidate], float],
    headroom: float,
) -> StageChoice | None:
    """Cheapest per request at the load ``num_cards`` sustain; ties: smaller TP."""
    best: StageChoice | None = None
    for cand in candidates:
        cap = capacities.get(cand.name)
        if cand.ledger is None or cap is None or cap.rate_rps <= 0 or cand.tp > num_cards:
            continue
        num_replicas = num_cards // cand.tp
        rate = num_replicas * cap.rate_rps / headroom
        choice = StageChoice(cand, cap, num_replicas, rate, num_cards * prices(cand))
        key = (choice.cost_per_request, cand.tp)
        if best is None or key < (best.cost_per_request, best.candidate.tp):
            best = choice
    return best


def gateway_cores(rate_rps: float, mean_output_tokens: float) -> float:
    """CPU cores the gateway spends proxying ``rate_rps`` streamed requests."""
    us_per_request = GATEWAY_CPU_US_PER_REQUEST + GATEWAY_CPU_US_PER_CHUNK * mean_output_tokens
    return rate_rps * us_per_request / 1e6


def _p(summary: Mapping[str, Any], metric: str, pct: int) -> float | None:
    value = (summary.get(f"{metric}_ms") or {}).get(f"p{pct}")
    return None if value is None else float(value)


def targets(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """P50/P95 TTFT, TPOT and E2E of the stage's run: its targets."""
    return {f"{m}_p{p}": _p(summary, m, p) for m in ("ttft", "tpot", "e2e") for p in (50, 95)}


def _backend_values(summary: Mapping[str, Any], key: str) -> list[float]:
    per_backend = summary.get("per_backend") or {}
    return [float(b[key]) for b in per_backend.values() if key in b]


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _deployment_item(choice: StageChoice, candidates: Sequence[Candidate]) -> StageItem:
    cand, led = choice.candidate, choice.candidate.ledger
    assert led is not None  # a choice is always a fitting candidate
    text = f"run {cand.gpu.name} TP{cand.tp} {cand.quant}, {choice.num_replicas} replica(s)"
    reason = (
        f"ledger per GPU: weights {led.weight_bytes_per_gpu / GIB:.1f} GiB, KV "
        f"{led.kv_cache_bytes_per_gpu / GIB:.1f} GiB = {led.kv_capacity_tokens:,} tokens "
        f"({led.max_num_full_sequences()} full-length sequences); one replica sustains "
        f"{choice.capacity.rate_rps:.3g} req/s at the SLO"
    )
    smaller = [c for c in candidates if c.gpu == cand.gpu and c.quant == cand.quant]
    misfits = [c for c in smaller if c.tp < cand.tp and c.reason is not None]
    if misfits:
        reason += f"; TP{misfits[-1].tp} does not fit: {misfits[-1].reason}"
    return StageItem(text, reason)


def must_dos(
    choice: StageChoice,
    summary: Mapping[str, Any],
    candidates: Sequence[Candidate],
    mean_output_tokens: float,
    policy: str,
) -> tuple[list[StageItem], list[StageItem]]:
    """(must-dos, mechanisms not needed yet) for a stage, each with its reason."""
    do = [_deployment_item(choice, candidates)]
    skip: list[StageItem] = []
    cand, n = choice.candidate, choice.num_replicas
    led = cand.ledger
    assert led is not None
    e2e_mean_s = float((summary.get("e2e_ms") or {}).get("mean") or 0.0) / 1000.0
    in_flight = choice.rate_rps / n * e2e_mean_s
    do.append(
        StageItem(
            f"size max_num_seqs for ~{in_flight:.0f} requests in flight per replica",
            f"Little's law on the run: {choice.rate_rps / n:.3g} req/s x {e2e_mean_s:.2f} s "
            f"mean E2E; the KV cache holds {led.max_num_full_sequences()} full-length sequences",
            in_flight,
        )
    )
    if cand.tp > 1:
        do.append(
            StageItem(
                f"keep each TP{cand.tp} group inside one node (NVLink)",
                "tensor parallelism all-reduces every layer at every decode step",
            )
        )
    do += _gateway_items(choice, summary, mean_output_tokens, policy, skip)
    return do, skip


def _gateway_items(
    choice: StageChoice,
    summary: Mapping[str, Any],
    mean_output_tokens: float,
    policy: str,
    skip: list[StageItem],
) -> list[StageItem]:
    n, cards = choice.num_replicas, choice.num_replicas * choice.candidate.tp
    num_nodes = math.ceil(cards / GPUS_PER_NODE)
    out: list[StageItem] = []
    if n < 2:
        skip.append(StageItem("a gateway", "one replica: nothing to choose between"))
        return out
    spread = _std(_backend_values(summary, "utilisation_mean")) * 100.0
    out.append(
        StageItem(
            f"gateway with load-aware routing ({policy}), probes and outlier ejection",
            f"{n} replicas share the load; utilisation spread across them {spread:.1f} pp "
            "in the run",
        )
    )
    share = 100.0 / n
    if n >= DEMOTION_MIN_REPLICAS:
        out.append(
            StageItem(
                "slow-node demotion on (rolling TPOT > 300 ms -> weight 20%)",
                f"one slow replica of {n} would hold {share:.1f}% of requests; the pool's "
                "median TPOT is the yardstick",
            )
        )
    else:
        skip.append(StageItem("slow-node demotion", f"{n} replicas: no pool median to compare"))
    if num_nodes > 1:
        out.append(
            StageItem(
                "etcd registry with a node agent per node; two gateways behind an L4 balancer",
                f"{cards} cards = {num_nodes} nodes of {GPUS_PER_NODE}: replicas join, drain "
                "and fail without a restart; one gateway would be a single point of failure",
            )
        )
    else:
        skip.append(StageItem("etcd registry", f"{cards} cards fit one node: a static list"))
    cores = gateway_cores(choice.rate_rps, mean_output_tokens)
    workers = max(1, math.ceil(cores / MAX_CORE_SHARE))
    if workers > 1:
        out.append(
            StageItem(
                f"gateway workers: {workers} in all (--workers, or more gateways)",
                f"{choice.rate_rps:.3g} req/s x ({GATEWAY_CPU_US_PER_REQUEST:g} us + "
                f"{mean_output_tokens:.0f} chunks x {GATEWAY_CPU_US_PER_CHUNK:g} us) = "
                f"{cores:.2f} cores of proxying",
                cores,
            )
        )
    out += _prefix_and_admission(summary, n, skip)
    return out


def _prefix_and_admission(
    summary: Mapping[str, Any], num_replicas: int, skip: list[StageItem]
) -> list[StageItem]:
    out: list[StageItem] = []
    hit_rate = (summary.get("prefix_cache") or {}).get("hit_rate") or 0.0
    if hit_rate >= MIN_PREFIX_HIT_RATE:
        out.append(
            StageItem(
                "prefix-aware routing (KV events or the prefix scorer)",
                f"the engines' prefix-cache hit rate is {hit_rate:.1%} over {num_replicas} "
                "replicas: blind spreading divides those hits",
                hit_rate,
            )
        )
    else:
        skip.append(StageItem("prefix-aware routing", f"prefix-cache hit rate {hit_rate:.1%}"))
    p50, p99 = _p(summary, "ttft", 50), _p(summary, "ttft", 99)
    ratio = p99 / p50 if p50 and p99 else 0.0
    if ratio >= ADMISSION_TAIL_RATIO:
        out.append(
            StageItem(
                "gateway admission (two-level queue: short requests ahead of long ones)",
                f"TTFT P99 / P50 = {ratio:.1f} in the run: requests queue behind others",
                ratio,
            )
        )
    else:
        skip.append(StageItem("admission control", f"TTFT P99 / P50 = {ratio:.1f}"))
    return out


def indicators(
    choice: StageChoice,
    summary: Mapping[str, Any],
    previous: StageChoice | None,
    mean_output_tokens: float,
) -> list[StageItem]:
    """The numbers to watch at this stage, with their values in the run."""
    n = choice.num_replicas
    kv = _backend_values(summary, "kv_usage_mean")
    kv_max = _backend_values(summary, "kv_usage_max")
    util = _backend_values(summary, "utilisation_mean")
    out = [
        StageItem(
            "KV-cache usage, mean (max) per backend",
            f"{_mean(kv):.0%} ({max(kv_max, default=0.0):.0%}): the memory that grows with "
            "concurrency (S4.2)",
            _mean(kv),
        ),
        StageItem("GPU busy fraction, mean", f"{_mean(util):.0%} at 1/headroom load", _mean(util)),
    ]
    if n >= 2:
        spread = _std(util) * 100.0
        out.append(
            StageItem(
                "utilisation std-dev across backends (pp)",
                f"{spread:.1f} pp: the load balance the routing achieves",
                spread,
            )
        )
        cores = gateway_cores(choice.rate_rps, mean_output_tokens)
        out.append(
            StageItem(
                "gateway CPU (cores)",
                f"{cores:.2f}: proxy work grows with req/s and streamed tokens",
                cores,
            )
        )
    if choice.num_replicas * choice.candidate.tp >= PARETO_MIN_CARDS:
        before = previous.cost_per_request if previous is not None else math.nan
        out.append(
            StageItem(
                f"$/request (Pareto analysis every +{PARETO_STEP_CARDS} cards)",
                f"${choice.cost_per_request:.5f} here vs ${before:.5f} at the previous stage: "
                "stop adding cards when it stops falling",
                choice.cost_per_request,
            )
        )
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def build_stage(
    index: int,
    num_cards: int,
    choice: StageChoice | None,
    summary: Mapping[str, Any] | None,
    *,
    candidates: Sequence[Candidate],
    previous: StageChoice | None,
    mean_output_tokens: float,
    policy: str,
) -> Stage:
    """A stage from its choice and its simulated run (None: nothing fits in the cards)."""
    stage = Stage(index, num_cards, choice)
    if choice is None or summary is None:
        stage.must_dos.append(_no_fit_item(num_cards, candidates))
        return stage
    stage.targets_ms = targets(summary)
    stage.must_dos, stage.not_needed = must_dos(
        choice, summary, candidates, mean_output_tokens, policy
    )
    stage.indicators = indicators(choice, summary, previous, mean_output_tokens)
    return stage


def _no_fit_item(num_cards: int, candidates: Sequence[Candidate]) -> StageItem:
    small = [c for c in candidates if c.tp <= num_cards]
    why = "; ".join(f"{c.name}: {c.reason or 'misses the SLO at every rate'}" for c in small)
    return StageItem(
        f"nothing in {num_cards} card(s) fits and meets the SLO: quantise (--quant int4), "
        "use larger cards or relax the SLO",
        why or f"no candidate with TP <= {num_cards}",
    )
