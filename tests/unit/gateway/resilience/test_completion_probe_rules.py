"""The completion probe's rules (issue 17): which engines get it by default, and a
time-out on a backend that made progress on real traffic meanwhile is "busy", never a
failure (so a loaded pool does not eject its backends one after another)."""

from __future__ import annotations

import random
import time

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.gateway.resilience.health import HealthConfig, wants_completion_probe
from kiloserve.gateway.resilience.manager import PROBE_VETO, Resilience
from kiloserve.gateway.resilience.prober import COMPLETION_TIMEOUT
from kiloserve.policies.least_request import LeastRequestPolicy
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable


@pytest.mark.parametrize(
    ("setting", "engine", "expected"),
    [
        ("auto", "vllm", True),
        ("auto", "sglang", True),
        ("auto", "llamacpp", False),
        ("auto", "tgi", False),
        ("auto", None, False),
        (True, "llamacpp", True),
        (False, "vllm", False),
    ],
)
def test_which_engines_get_the_completion_probe(
    setting: bool | str, engine: str | None, expected: bool
) -> None:
    assert wants_completion_probe(setting, engine) is expected  # type: ignore[arg-type]


def test_the_completion_probe_is_auto_by_default() -> None:
    assert HealthConfig().completion_probe == "auto"


def _resilience() -> Resilience:
    cfg = parse_gateway_config({"backends": [{"url": "http://127.0.0.1:9", "name": "b"}]})
    table = BackendTable(cfg)
    router = Router(table, LeastRequestPolicy(), random.Random(0))
    return Resilience(cfg, router, GatewayMetrics(table))


def test_a_timeout_while_real_traffic_progresses_is_busy_not_a_failure() -> None:
    r = _resilience()
    started = time.monotonic()
    r.on_first_token("b", None, 5.0)  # type: ignore[arg-type]  # progress after the start
    for _ in range(3):
        r._on_probe("b", False, COMPLETION_TIMEOUT, started)
    assert r.num_probes == {("b", "busy"): 3}
    assert PROBE_VETO not in r.table.record("b").vetoes


def test_a_timeout_without_progress_counts_and_ejects() -> None:
    r = _resilience()
    r.on_first_token("b", None, 5.0)  # type: ignore[arg-type]  # progress, then a hang
    later = time.monotonic() + 1.0
    r._on_probe("b", False, COMPLETION_TIMEOUT, later)
    r._on_probe("b", False, COMPLETION_TIMEOUT, later)
    assert r.num_probes == {("b", "fail"): 2}
    assert PROBE_VETO in r.table.record("b").vetoes


def test_the_latest_probe_failure_is_in_the_backend_row() -> None:
    # `kiloserve doctor` reads it: a backend held out for 5xx probes sees no request
    r = _resilience()
    now = time.monotonic()
    (row,) = r.table.describe(now)
    assert row["probe_failure"] == ""
    for _ in range(2):
        r._on_probe("b", False, "completion http 500", now)
    (row,) = r.table.describe(now)
    assert (row["probe_failure"], row["healthy"]) == ("completion http 500", False)
    r._on_probe("b", True, "", now)  # one pass: still held out, the reason stays
    (row,) = r.table.describe(now)
    assert (row["probe_failure"], row["healthy"]) == ("completion http 500", False)
    r._on_probe("b", True, "", now)
    (row,) = r.table.describe(now)
    assert (row["probe_failure"], row["healthy"]) == ("", True)
