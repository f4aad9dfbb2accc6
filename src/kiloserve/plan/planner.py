"""Capacity arithmetic and candidate deployments (SPEC S4.4, S4.5).

* Candidates: every GPU type x TP degree (1, 2, 4, 8: inside one node) x quantisation,
  each with its memory ledger (``kiloserve.catalog.memory``) or the reason it does not fit.
  S4.4's rule of thumb, ``min_tp_for_weights``, is shown beside: TP = ceil(weights /
  usable memory per card) rounded up to a power of two (the ledger then checks the
  activations, runtime and KV headroom that rule ignores).
* Replicas (S4.5): ``ceil(target / per_replica x headroom)``, headroom 1.25 by default;
  cards = replicas x TP. Seed 002's example: 10,000 tok/s at 40 tok/s per TP4 replica
  is 250 replicas = 1,000 cards with no headroom (313 replicas with 1.25).
* KV cross-check (S4.5, seed 003): KV bytes needed = QPS x mean output tokens x KV
  bytes per token; replicas = ceil(needed x (1 + redundancy) / KV cache bytes of one
  replica), redundancy 25% (the seed says 20-30%). The seed's formula holds each
  output token's KV for about one second; it is a cross-check, not the plan.
* Cost: cards x price per GPU-hour; per million output tokens and per request at the
  target load (the headroom is paid for, not used).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from kiloserve.catalog import GIB, GpuSpec, ModelSpec, normalize_name
from kiloserve.catalog.memory import MemoryLedger, build_ledger, plan_memory
from kiloserve.errors import ConfigError, DoesNotFitError
from kiloserve.plan.capacity import CapacityResult
from kiloserve.results.tables import fmt

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_KV_REDUNDANCY",
    "TP_DEGREES",
    "Candidate",
    "Deployment",
    "KvCheck",
    "cost_per_million_tokens",
    "cost_per_request",
    "deployment_table",
    "enumerate_candidates",
    "kv_capacity_check",
    "ledger_table",
    "min_tp_for_weights",
    "parse_prices",
    "plan_deployment",
    "price_for",
    "print_reasons",
    "rank_deployments",
    "replicas_needed",
]

DEFAULT_HEADROOM = 1.25
DEFAULT_KV_REDUNDANCY = 0.25
TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
_EPSILON = 1e-9  # 250.0000000001 replicas is 250, not 251


def replicas_needed(target: float, per_replica: float, headroom: float = DEFAULT_HEADROOM) -> int:
    """``ceil(target / per_replica x headroom)`` in any one throughput unit."""
    if not per_replica > 0:
        raise ConfigError(f"per-replica throughput must be > 0, got {per_replica}")
    if target < 0 or not headroom >= 1.0:
        raise ConfigError(f"need target >= 0 and headroom >= 1, got {target}, {headroom}")
    return max(1, math.ceil(target / per_replica * headroom - _EPSILON))


def min_tp_for_weights(weight_bytes: float, usable_bytes_per_gpu: float) -> int:
    """S4.4: ``ceil(weights / usable memory per card)`` rounded up to a power of two."""
    if not usable_bytes_per_gpu > 0:
        raise ConfigError("usable memory per GPU must be > 0")
    num_cards = max(1, math.ceil(weight_bytes / usable_bytes_per_gpu - _EPSILON))
    return 1 << (num_cards - 1).bit_length()


def cost_per_million_tokens(cost_per_hour: float, tokens_per_s: float) -> float:
    """Dollars per million tokens at ``tokens_per_s`` (inf when nothing is served)."""
    if tokens_per_s <= 0:
        return math.inf
    return cost_per_hour / (tokens_per_s * 3600.0) * 1e6


def cost_per_request(cost_per_hour: float, requests_per_s: float) -> float:
    """Dollars per request at ``requests_per_s`` (inf when nothing is served)."""
    if requests_per_s <= 0:
        return math.inf
    return cost_per_hour / (requests_per_s * 3600.0)


@dataclass(frozen=True, slots=True)
class KvCheck:
    """S4.5's KV-memory sizing of the same target (see the module docstring)."""

    kv_bytes_needed: float
    redundancy: float
    kv_bytes_per_replica: int
    num_replicas: int
    num_cards: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "kv_gib_needed": self.kv_bytes_needed / GIB,
            "redundancy": self.redundancy,
            "kv_gib_per_replica": self.kv_bytes_per_replica / GIB,
            "num_replicas": self.num_replicas,
            "num_cards": self.num_cards,
        }


def kv_capacity_check(
    rate_rps: float,
    mean_output_tokens: float,
    kv_bytes_per_token: int,
    kv_bytes_per_replica: int,
    tp: int,
    redundancy: float = DEFAULT_KV_REDUNDANCY,
) -> KvCheck:
    """QPS x mean output tokens x KV bytes/token, plus ``redundancy``, in replicas and cards."""
    if kv_bytes_per_replica <= 0:
        raise ConfigError("a replica with no KV cache cannot serve")
    if not 0 <= redundancy < 10:
        raise ConfigError(f"KV redundancy must be in [0, 10), got {redundancy}")
    needed = rate_rps * mean_output_tokens * kv_bytes_per_token
    num_replicas = max(1, math.ceil(needed * (1 + redundancy) / kv_bytes_per_replica - _EPSILON))
    return KvCheck(needed, redundancy, kv_bytes_per_replica, num_replicas, num_replicas * tp)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One GPU type x TP x quantisation: its ledger, or why it does not fit."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int
    quant: str
    ledger: MemoryLedger | None
    reason: str | None = None
    issue: str | None = None  # "heads", "weights" or "kv" when it does not fit

    @property
    def is_fitting(self) -> bool:
        return self.ledger is not None

    @property
    def name(self) -> str:
        return f"{self.gpu.name} TP{self.tp} {self.quant}"

    def ledger_dict(self) -> dict[str, Any]:
        """Per-GPU ledger in GiB (weights / KV / reserve) and KV tokens, or the reason."""
        out: dict[str, Any] = {"gpu": self.gpu.name, "tp": self.tp, "quant": self.quant}
        if self.ledger is None:
            return out | {"fits": False, "issue": self.issue, "reason": self.reason}
        led = self.ledger
        reserve = led.memory_bytes_per_gpu - led.weight_bytes_per_gpu - led.kv_cache_bytes_per_gpu
        return out | {
            "fits": True,
            "memory_gib_per_gpu": led.memory_bytes_per_gpu / GIB,
            "weights_gib_per_gpu": led.weight_bytes_per_gpu / GIB,
            "kv_gib_per_gpu": led.kv_cache_bytes_per_gpu / GIB,
            "reserve_gib_per_gpu": reserve / GIB,
            "num_kv_blocks": led.num_kv_blocks,
            "kv_tokens": led.kv_capacity_tokens,
            "max_num_full_sequences": led.max_num_full_sequences(),
        }


def enumerate_candidates(
    model: ModelSpec,
    gpus: Sequence[GpuSpec],
    quants: Sequence[str] = ("bf16",),
    tps: Sequence[int] = TP_DEGREES,
    max_model_len: int | None = None,
) -> list[Candidate]:
    """Every GPU x TP x quantisation with its ledger or the reason it does not fit."""
    out: list[Candidate] = []
    for gpu in gpus:
        for quant in (normalize_name(q) for q in quants):
            for tp in tps:
                out.append(_candidate(gpu, model, tp, quant, max_model_len))
    return out


def _candidate(
    gpu: GpuSpec, model: ModelSpec, tp: int, quant: str, max_model_len: int | None
) -> Candidate:
    if model.num_attention_heads % tp:
        reason = f"TP{tp} does not divide {model.num_attention_heads} attention heads"
        return Candidate(gpu, model, tp, quant, None, reason, "heads")
    try:
        ledger = plan_memory(gpu, model, tp, quant, max_model_len=max_model_len)
    except DoesNotFitError as exc:
        raw = build_ledger(gpu, model, tp, quant, max_model_len=max_model_len)
        issue = "kv" if raw.is_weights_fitting else "weights"
        return Candidate(gpu, model, tp, quant, None, str(exc), issue)
    return Candidate(gpu, model, tp, quant, ledger)


@dataclass(frozen=True, slots=True)
class Deployment:
    """A candidate sized for the target: replicas, cards, cost and the KV cross-check."""

    candidate: Candidate
    capacity: CapacityResult
    target_rps: float
    mean_output_tokens: float
    headroom: float
    price_per_gpu_hour: float
    num_replicas: int
    kv_check: KvCheck

    @property
    def num_cards(self) -> int:
        return self.num_replicas * self.candidate.tp

    @property
    def cost_per_hour(self) -> float:
        return self.num_cards * self.price_per_gpu_hour

    @property
    def cost_per_million_output_tokens(self) -> float:
        tokens_per_s = self.target_rps * self.mean_output_tokens
        return cost_per_million_tokens(self.cost_per_hour, tokens_per_s)

    @property
    def cost_per_request(self) -> float:
        return cost_per_request(self.cost_per_hour, self.target_rps)

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "gpu": c.gpu.name,
            "tp": c.tp,
            "quant": c.quant,
            "per_replica_rps": self.capacity.rate_rps,
            "per_replica_output_tokens_per_s": self.capacity.output_tokens_per_s,
            "capacity_source": self.capacity.source,
            "headroom": self.headroom,
            "num_replicas": self.num_replicas,
            "num_cards": self.num_cards,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "cost_per_hour": self.cost_per_hour,
            "cost_per_million_output_tokens": self.cost_per_million_output_tokens,
            "cost_per_request": self.cost_per_request,
            "kv_check": self.kv_check.to_dict(),
        }


def plan_deployment(
    candidate: Candidate,
    capacity: CapacityResult,
    target_rps: float,
    mean_output_tokens: float,
    *,
    price_per_gpu_hour: float,
    headroom: float = DEFAULT_HEADROOM,
    kv_redundancy: float = DEFAULT_KV_REDUNDANCY,
) -> Deployment | None:
    """Size ``candidate`` for ``target_rps``; None when one replica cannot meet the SLO."""
    ledger = candidate.ledger
    if ledger is None or capacity.rate_rps <= 0:
        return None
    num_replicas = replicas_needed(target_rps, capacity.rate_rps, headroom)
    kv_per_replica = ledger.kv_cache_bytes_per_gpu * candidate.tp
    kv_check = kv_capacity_check(
        target_rps,
        mean_output_tokens,
        candidate.model.kv_bytes_per_token(ledger.kv_dtype),
        kv_per_replica,
        candidate.tp,
        kv_redundancy,
    )
    return Deployment(
        candidate,
        capacity,
        target_rps,
        mean_output_tokens,
        headroom,
        price_per_gpu_hour,
        num_replicas,
        kv_check,
    )


def rank_deployments(deployments: Iterable[Deployment]) -> list[Deployment]:
    """Cheapest first; ties by fewer cards, then smaller TP."""
    return sorted(deployments, key=lambda d: (d.cost_per_hour, d.num_cards, d.candidate.tp))


def parse_prices(text: str | None) -> dict[str, float]:
    """``H100=2.5,A100=1.8`` -> {normalized name: dollars per GPU-hour}."""
    prices: dict[str, float] = {}
    if not text:
        return prices
    for part in "".join(text.split()).split(","):
        name, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name or not price >= 0:
            raise ConfigError(f"bad --price {part!r}; expected GPU=DOLLARS_PER_HOUR, e.g. H100=2.5")
        prices[normalize_name(name)] = price
    return prices


def price_for(gpu: GpuSpec, prices: Mapping[str, float]) -> float:
    """The ``--price`` for ``gpu`` (by name or alias), else the catalog's list price."""
    for name in (gpu.name, *gpu.aliases):
        key = normalize_name(name)
        if key in prices:
            return prices[key]
    return gpu.cost_per_hour


# --- tables for the terminal ---------------------------------------------------

_ISSUE_TEXT = {"heads": "TP vs heads", "weights": "weights", "kv": "KV < 1 sequence"}


def _rule_of_thumb_tp(gpu: GpuSpec, cand: Candidate) -> int:
    usable = gpu.memory_bytes * 0.92
    return min_tp_for_weights(cand.model.weight_bytes(cand.quant), usable)


def ledger_table(candidates: Sequence[Candidate]) -> Table:
    """Per-GPU memory ledger of every candidate (GiB), or why it does not fit."""
    table = Table(title="Memory ledger per GPU (GiB)")
    for col in ("GPU", "TP", "quant", "weights", "KV", "reserve", "KV tokens", "S4.4 TP"):
        table.add_column(col, justify="left" if col in ("GPU", "quant") else "right")
    table.add_column("fits")
    for cand in candidates:
        row = cand.ledger_dict()
        rule_tp = str(_rule_of_thumb_tp(cand.gpu, cand))
        if not row["fits"]:
            cells = ["-", "-", "-", "-", rule_tp, f"no: {_ISSUE_TEXT[str(row['issue'])]}"]
        else:
            cells = [
                fmt(row["weights_gib_per_gpu"]),
                fmt(row["kv_gib_per_gpu"]),
                fmt(row["reserve_gib_per_gpu"]),
                f"{row['kv_tokens']:,}",
                rule_tp,
                "yes",
            ]
        table.add_row(cand.gpu.name, str(cand.tp), cand.quant, *cells)
    return table


def print_reasons(console: Console, candidates: Sequence[Candidate]) -> None:
    for cand in candidates:
        if cand.reason is not None:
            console.print(f"  {cand.name}: {cand.reason}", highlight=False)


def deployment_table(deployments: Sequence[Deployment], target_rps: float, slo: str) -> Table:
    """Deployments that meet the SLO, cheapest first."""
    table = Table(title=f"Deployments for {target_rps:g} req/s at {slo}, cheapest first")
    cols = (
        "#",
        "GPU",
        "TP",
        "quant",
        "req/s/replica",
        "tok/s/replica",
        "replicas",
        "cards",
        "$/hour",
        "$/M out tok",
        "$/request",
        "KV-check cards",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("GPU", "quant") else "right")
    for i, d in enumerate(deployments, 1):
        c = d.candidate
        table.add_row(
            str(i),
            c.gpu.name,
            str(c.tp),
            c.quant,
            fmt(d.capacity.rate_rps, 2),
            fmt(d.capacity.output_tokens_per_s),
            str(d.num_replicas),
            str(d.num_cards),
            fmt(d.cost_per_hour, 2),
            fmt(d.cost_per_million_output_tokens, 2),
            f"{d.cost_per_request:.2e}",
            str(d.kv_check.num_cards),
        )
    return table
