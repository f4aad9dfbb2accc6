"""``benchmarks/soak.py``'s RSS verdict: warm-up ends once the prefix index is full.

Issue 15: the default policy's approximate prefix index fills to its cap (174,000
blocks, about 25 MiB) over the first minutes of a soak; that growth is the bounded
cache warming up, not a leak, so the RSS target is judged from the first report that
finds the index at its cap. A run that ends before then is judged from the first report
as before, and says the index was still filling.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_under_test", _SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _result(rows: list[tuple[float, int | None, int | None]]) -> dict[str, Any]:
    samples = [
        {"t_s": 30.0 * (i + 1), "rss_mib": rss, "fds": 100, "prefix_blocks": blocks,
         "prefix_max_blocks": cap}
        for i, (rss, blocks, cap) in enumerate(rows)
    ]  # fmt: skip
    return {
        "samples": samples, "user_visible_failures": 0, "requests": 10, "failure_reasons": {},
        "health_p50_ms": 1.0, "health_p99_ms": 1.0, "health_max_ms": 1.0, "faults": [],
    }  # fmt: skip


def test_growth_is_judged_from_the_report_that_finds_the_index_full() -> None:
    rows = [(60.0, 50, 200), (80.0, 200, 200), (81.0, 200, 200), (82.0, 200, 200)]
    lines, ok = _soak().verdict(_result(rows))
    assert ok, lines
    assert "80.0 MiB after warm-up (t=60 s, the prefix index at its cap)" in lines[0]
    assert "growth +2.5%" in lines[0] and lines[0].endswith(": met")
    assert "from the first report" in lines[1] and "+36.7%" in lines[1]


def test_an_index_still_filling_at_the_end_is_judged_from_the_first_report() -> None:
    rows = [(60.0, 50, 200), (70.0, 100, 200), (80.0, 150, 200)]
    lines, ok = _soak().verdict(_result(rows))
    assert not ok
    assert "60.0 MiB after warm-up (t=30 s)" in lines[0] and "growth +33.3%" in lines[0]
    assert "NOT met [the prefix index was still filling (150 of 200 blocks" in lines[0]


def test_without_a_prefix_index_warm_up_is_the_first_report() -> None:
    rows = [(60.0, None, None), (61.0, None, None), (62.0, None, None)]
    lines, ok = _soak().verdict(_result(rows))
    assert ok, lines
    assert "growth +3.3%" in lines[0] and lines[0].endswith(": met")
    assert "prefix index" not in " ".join(lines)
