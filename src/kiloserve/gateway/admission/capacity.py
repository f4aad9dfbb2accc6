"""Per-backend capacity for admission (S2.2, S2.3): KV budget and in-flight caps.

Pure functions of a ``BackendState`` plus the gateway's own reservations; no clock,
no I/O, so the simulator can reuse them.

* A request's memory need (S2.2) is its peak KV footprint: ``input + output`` tokens.
  With a known KV size per token (``kv_bytes_per_token[model]``) that is
  ``tokens * kv_bytes_per_token`` bytes; without one the seed-000 calibration is the
  fallback: ``input * 200 KB + output * 1500 KB``. The controller counts it in KV tokens
  (``memory_need_kv_tokens``): exact with a known size, else the seed's bytes over its
  200 KB per prompt token (``input + 7.5 * output``).
* A backend's used KV (``kv_estimate: reserved``, the default) is the larger of what
  its engine reports (``kv_usage * kv_capacity_tokens``) and what the gateway has
  reserved (peak need) for the requests it sent there that are still in flight (the
  engine's figure lags by a scrape interval; the reservation does not).
  ``kv_estimate: scraped`` packs tighter: the engine's figure plus what it does not
  hold yet (prompts not yet prefilled, ``decode_growth_frac`` of the expected output of
  the requests in flight, requests sent since the scrape).
* The engine's prefill queue (S2.3): a request that is not short goes to a backend
  only while the prompt tokens sent there and not yet answered with a first token
  (plus granted, unsent ones) stay within ``max_queued_prefill_tokens``, or while the
  engine's scrape shows no waiting request and at least as many running as the
  gateway granted there; so long prompts wait at the gateway (where short ones pass
  them), not in the engine's FIFO.
* The in-flight cap per backend is ``max_in_flight_per_backend``, reduced to
  ``reduced_max_in_flight`` while the backend is over its KV budget or its scraped KV
  usage is above ``kv_high_watermark`` (S2.3, per backend, not global).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiloserve.policies.base import BackendState

__all__ = [
    "SEED_INPUT_KB_PER_TOKEN",
    "SEED_OUTPUT_KB_PER_TOKEN",
    "CapacityConfig",
    "Room",
    "has_prefill_room",
    "has_room",
    "in_flight_cap",
    "is_engine_caught_up",
    "memory_need_bytes",
    "memory_need_kv_tokens",
    "memory_need_tokens",
]

SEED_INPUT_KB_PER_TOKEN = 200
SEED_OUTPUT_KB_PER_TOKEN = 1500


class CapacityConfig(BaseModel):
    """How much each backend may hold (the ``admission.capacity`` config section)."""

    model_config = ConfigDict(extra="forbid")

    kv_budget_frac: float = Field(default=0.95, gt=0.0, le=4.0)
    kv_estimate: Literal["reserved", "scraped"] = "reserved"
    decode_growth_frac: float = Field(default=0.5, ge=0.0, le=1.0)
    short_extra_budget_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    kv_high_watermark: float = Field(default=0.85, gt=0.0, le=1.0)
    max_queued_prefill_tokens: int | None = Field(default=8192, ge=1)
    max_in_flight_per_backend: int = Field(default=256, ge=1)
    reduced_max_in_flight: int = Field(default=16, ge=1)
    default_kv_capacity_tokens: int | None = Field(default=None, ge=1)
    kv_bytes_per_token: dict[str, int] = Field(default_factory=dict)


def memory_need_tokens(input_tokens: int, output_tokens: int) -> int:
    """Peak KV tokens a request holds: its prompt plus every output token."""
    return max(1, input_tokens + output_tokens)


def memory_need_bytes(
    input_tokens: int, output_tokens: int, kv_bytes_per_token: int | None = None
) -> int:
    """Peak KV bytes; the seed's ``input*200 KB + output*1500 KB`` when the size is unknown."""
    if kv_bytes_per_token is not None:
        return memory_need_tokens(input_tokens, output_tokens) * kv_bytes_per_token
    kb = input_tokens * SEED_INPUT_KB_PER_TOKEN + output_tokens * SEED_OUTPUT_KB_PER_TOKEN
    return max(1, kb) * 1024


def memory_need_kv_tokens(
    input_tokens: int, output_tokens: int, kv_bytes_per_token: int | None = None
) -> int:
    """``memory_need_bytes`` in KV tokens: ``input + output`` with a known size per token;
    else the seed's estimate over its per-prompt-token size (``input + 7.5 * output``)."""
    per_token = kv_bytes_per_token or SEED_INPUT_KB_PER_TOKEN * 1024
    need = memory_need_bytes(input_tokens, output_tokens, kv_bytes_per_token)
    return max(1, math.ceil(need / per_token))


def is_engine_caught_up(s: BackendState) -> bool:
    """The engine's fresh scrape says nothing waits and it runs every request the
    gateway granted there (so none of them is still queued, whatever the gateway's own
    prefill count says: a non-streamed request shows no first token until it ends)."""
    if s.scrape_stale or s.num_waiting != 0 or s.num_running is None:
        return False
    return s.admitted_in_flight <= s.num_running


def has_prefill_room(
    cfg: CapacityConfig,
    queued_prefill_tokens: int,
    input_tokens: int,
    is_short: bool,
    is_caught_up: bool = False,
) -> bool:
    """May a prompt of ``input_tokens`` join a backend whose engine has
    ``queued_prefill_tokens`` still to prefill (S2.3)? Short prompts always may (they
    join the running batch at once); an empty queue always takes one, and so does an
    engine that ``is_engine_caught_up``."""
    limit = cfg.max_queued_prefill_tokens
    if limit is None or is_short or queued_prefill_tokens <= 0 or is_caught_up:
        return True
    return queued_prefill_tokens + input_tokens <= limit


@dataclass(frozen=True, slots=True)
class Room:
    """Whether a backend can take a request now, and why not."""

    is_free: bool
    cap: int
    free_tokens: int | None
    reason: str = ""


def capacity_tokens(s: BackendState, cfg: CapacityConfig) -> int | None:
    """The backend's KV capacity in tokens, if known (state, else the configured default)."""
    if s.kv_capacity_tokens:
        return s.kv_capacity_tokens
    return cfg.default_kv_capacity_tokens


def used_tokens(
    s: BackendState, cfg: CapacityConfig, capacity: int, reserved_tokens: int, pending_tokens: int
) -> int:
    """KV in use (or promised). ``reserved``: the engine's figure or the gateway's peak
    reservations, whichever is larger. ``scraped``: the engine's figure plus
    ``pending_tokens``, what the engine does not hold yet (prompts not prefilled, half
    the expected output, requests sent since the scrape); reservations when stale."""
    if s.kv_usage is None:
        return reserved_tokens
    scraped = round(s.kv_usage * capacity)
    if cfg.kv_estimate == "scraped":
        return scraped + pending_tokens
    return max(scraped, reserved_tokens)


def in_flight_cap(s: BackendState, cfg: CapacityConfig, is_over_budget: bool) -> int:
    """The per-backend in-flight cap, reduced when KV is tight (S2.3)."""
    is_hot = s.kv_usage is not None and s.kv_usage > cfg.kv_high_watermark
    if is_hot or is_over_budget:
        return min(cfg.reduced_max_in_flight, cfg.max_in_flight_per_backend)
    return cfg.max_in_flight_per_backend


def has_room(
    s: BackendState,
    cfg: CapacityConfig,
    need_tokens: int,
    reserved_tokens: int,
    num_in_flight: int,
    pending_tokens: int = 0,
    is_short: bool = False,
) -> Room:
    """Can ``s`` take a request needing ``need_tokens`` of KV right now?

    ``reserved_tokens`` / ``num_in_flight`` are the gateway's own counts for ``s``. An
    idle backend always takes one request, even one larger than its budget. A short
    request (``is_short``) may use ``short_extra_budget_frac`` more: headroom that long
    requests cannot take, so short ones find room even when KV is tight.
    """
    capacity = capacity_tokens(s, cfg)
    if capacity is None:
        cap = cfg.max_in_flight_per_backend
        return Room(num_in_flight < cap, cap, None, "" if num_in_flight < cap else "in_flight_cap")
    extra = cfg.short_extra_budget_frac if is_short else 0.0
    budget = int(capacity * (cfg.kv_budget_frac + extra))
    free = budget - used_tokens(s, cfg, capacity, reserved_tokens, pending_tokens)
    cap = in_flight_cap(s, cfg, is_over_budget=free < 0)
    if num_in_flight >= cap:
        return Room(False, cap, free, "in_flight_cap")
    if num_in_flight > 0 and need_tokens > free:
        return Room(False, cap, free, "kv_budget")
    return Room(True, cap, free)
