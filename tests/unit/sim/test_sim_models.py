"""Which model each simulated request asks for."""

from __future__ import annotations

from collections import Counter

import pytest

from kiloserve.errors import ConfigError
from kiloserve.sim.gateway import ModelPicker


def test_fixed_model_is_always_picked() -> None:
    picker = ModelPicker({"a": 4.0, "b": 1.0}, "b", seed=0)
    assert {picker.pick() for _ in range(50)} == {"b"}


def test_draws_follow_the_gpu_shares_and_the_seed() -> None:
    picker = ModelPicker({"a": 3.0, "b": 1.0}, None, seed=0)
    draws = Counter(picker.pick() for _ in range(8000))
    assert draws["a"] / 8000 == pytest.approx(0.75, abs=0.02)

    def sequence(seed: int) -> list[str]:
        picker = ModelPicker({"a": 1.0, "b": 1.0}, None, seed=seed)
        return [picker.pick() for _ in range(40)]

    assert sequence(5) == sequence(5)
    assert sequence(5) != sequence(6)


def test_unknown_model_names_the_served_ones() -> None:
    with pytest.raises(ConfigError, match="served: a, b"):
        ModelPicker({"a": 1.0, "b": 1.0}, "c", seed=0)
