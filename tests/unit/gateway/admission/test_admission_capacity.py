"""Per-backend capacity: memory need, KV budget, reduced in-flight caps (S2.2, S2.3)."""

from __future__ import annotations

from kiloserve.gateway.admission.capacity import (
    CapacityConfig,
    has_room,
    in_flight_cap,
    memory_need_bytes,
    memory_need_tokens,
)
from kiloserve.policies.base import BackendState


def test_memory_need_uses_kv_bytes_or_the_seed_fallback() -> None:
    assert memory_need_tokens(100, 50) == 150
    assert memory_need_bytes(100, 50, kv_bytes_per_token=131072) == 150 * 131072
    assert memory_need_bytes(100, 50) == (100 * 200 + 50 * 1500) * 1024


def test_budget_counts_the_larger_of_scraped_and_reserved() -> None:
    cfg = CapacityConfig(kv_budget_frac=1.0)
    s = BackendState("b", kv_capacity_tokens=1000, kv_usage=0.5)
    room = has_room(s, cfg, need_tokens=400, reserved_tokens=100, num_in_flight=1)
    assert room.is_free and room.free_tokens == 500
    room = has_room(s, cfg, need_tokens=400, reserved_tokens=700, num_in_flight=1)
    assert not room.is_free and room.reason == "kv_budget"


def test_an_idle_backend_takes_one_request_larger_than_its_budget() -> None:
    cfg = CapacityConfig()
    s = BackendState("b", kv_capacity_tokens=1000, kv_usage=0.0)
    assert has_room(s, cfg, need_tokens=5000, reserved_tokens=0, num_in_flight=0).is_free
    assert not has_room(s, cfg, need_tokens=5000, reserved_tokens=5000, num_in_flight=1).is_free


def test_high_kv_usage_reduces_the_cap_per_backend() -> None:
    cfg = CapacityConfig(max_in_flight_per_backend=256, reduced_max_in_flight=16)
    hot = BackendState("hot", kv_capacity_tokens=100_000, kv_usage=0.9)
    cool = BackendState("cool", kv_capacity_tokens=100_000, kv_usage=0.5)
    assert in_flight_cap(hot, cfg, is_over_budget=False) == 16
    assert in_flight_cap(cool, cfg, is_over_budget=False) == 256
    assert in_flight_cap(cool, cfg, is_over_budget=True) == 16
    assert not has_room(hot, cfg, 10, reserved_tokens=0, num_in_flight=16).is_free
    assert has_room(cool, cfg, 10, reserved_tokens=0, num_in_flight=16).is_free


def test_unknown_capacity_falls_back_to_the_in_flight_cap() -> None:
    cfg = CapacityConfig(max_in_flight_per_backend=2)
    s = BackendState("b")
    assert has_room(s, cfg, 10**9, reserved_tokens=0, num_in_flight=1).is_free
    assert not has_room(s, cfg, 1, reserved_tokens=0, num_in_flight=2).is_free
    with_default = CapacityConfig(default_kv_capacity_tokens=100, kv_budget_frac=1.0)
    assert not has_room(s, with_default, 50, reserved_tokens=80, num_in_flight=1).is_free


def test_scraped_estimate_adds_what_the_engine_does_not_hold_yet() -> None:
    cfg = CapacityConfig(kv_budget_frac=1.0, kv_estimate="scraped")
    s = BackendState("b", kv_capacity_tokens=1000, kv_usage=0.5)
    # reservations say 900 (peak), but the engine holds 500 and 200 are still to come
    room = has_room(
        s, cfg, need_tokens=250, reserved_tokens=900, num_in_flight=3, pending_tokens=200
    )
    assert room.is_free and room.free_tokens == 300
    assert not has_room(
        s, cfg, 350, reserved_tokens=900, num_in_flight=3, pending_tokens=200
    ).is_free
    stale = BackendState("b", kv_capacity_tokens=1000, kv_usage=None)  # no scrape: reservations
    assert not has_room(stale, cfg, 250, reserved_tokens=900, num_in_flight=3).is_free


def test_short_requests_get_extra_headroom() -> None:
    cfg = CapacityConfig(kv_budget_frac=0.9, short_extra_budget_frac=0.05)
    s = BackendState("b", kv_capacity_tokens=1000, kv_usage=0.0)
    assert not has_room(s, cfg, 40, reserved_tokens=880, num_in_flight=5).is_free
    assert has_room(s, cfg, 40, reserved_tokens=880, num_in_flight=5, is_short=True).is_free
