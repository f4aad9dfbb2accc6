"""Parsing ``--workload`` strings and length distributions."""

from __future__ import annotations

import pytest

from kiloserve.errors import ConfigError
from kiloserve.workload.spec import Dist, parse_dist, parse_workload_spec


def test_trace_names_and_synthetic_options() -> None:
    assert parse_workload_spec("mooncake").is_trace
    spec = parse_workload_spec("synthetic: input=lognormal(1000, 0.8), output=uniform(10,50)")
    assert spec.kind == "synthetic"
    assert spec.options == {"input": "lognormal(1000,0.8)", "output": "uniform(10,50)"}
    assert parse_workload_spec("mix:chat=0.8,longdoc=0.2").options == {
        "chat": "0.8",
        "longdoc": "0.2",
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fixed(128)", Dist("fixed", (128.0,))),
        ("128", Dist("fixed", (128.0,))),
        ("uniform(10,50)", Dist("uniform", (10.0, 50.0))),
        ("lognormal(1000,0.8)", Dist("lognormal", (1000.0, 0.8))),
        ("normal(300,20)", Dist("normal", (300.0, 20.0))),
    ],
)
def test_parse_dist(text: str, expected: Dist) -> None:
    assert parse_dist(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("azure", "unknown workload"),
        ("synthetic", "needs options"),
        ("synthetic:input=fixed(1", "unbalanced"),
        ("synthetic:input", "KEY=VALUE"),
        ("synthetic:input=1,input=2", "twice"),
    ],
)
def test_bad_specs_name_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_workload_spec(text)


@pytest.mark.parametrize(
    "text", ["gauss(1,2)", "fixed(0)", "uniform(50,10)", "lognormal(1)", "fixed(a)", "x"]
)
def test_bad_distributions(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_dist(text)


def test_public_surface_is_importable() -> None:
    import kiloserve.workload as workload

    assert sorted(workload.__all__) == sorted(set(workload.__all__))
    for name in workload.__all__:
        assert hasattr(workload, name), name
