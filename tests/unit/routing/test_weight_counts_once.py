"""A configured weight counts once: ``effective_weight`` is the health factor (1.0 as
configured), so weight 2 gets twice the share of weight 1, not four times (the table
used to start ``effective_weight`` at the configured weight, squaring it)."""

from __future__ import annotations

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.policies.signals import capacity_weight
from kiloserve.routing.table import BackendTable


def test_a_configured_weight_counts_once() -> None:
    cfg = parse_gateway_config(
        {
            "backends": [
                {"url": "http://127.0.0.1:1", "name": "a", "models": ["m"], "weight": 2.0},
                {"url": "http://127.0.0.1:2", "name": "b", "models": ["m"], "weight": 1.0},
            ]
        }
    )
    table = BackendTable(cfg)
    a, b = table.state("a"), table.state("b")
    assert a.effective_weight == b.effective_weight == 1.0
    assert capacity_weight(a) / capacity_weight(b) == 2.0
    assert table.describe(0.0)[0]["effective_weight"] == 1.0
