"""Tracing's configuration (issue 18): the gateway's YAML section, the twin's flag,
off by default, and a clear error when the OpenTelemetry extra is missing."""

from __future__ import annotations

import argparse
import sys

import pytest

from kiloserve.engine.cli import add_arguments, config_from_args
from kiloserve.errors import ConfigError
from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import parse_gateway_config

BACKENDS = [{"url": "http://127.0.0.1:9", "models": ["m"]}]


def test_tracing_section_defaults_off_and_rejects_unknown_keys() -> None:
    cfg = parse_gateway_config({"backends": BACKENDS})
    assert cfg.tracing.enabled is False
    assert cfg.tracing.otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert cfg.tracing.service_name == "kiloserve-gateway"
    on = parse_gateway_config({"backends": BACKENDS, "tracing": {"enabled": True}})
    assert on.tracing.enabled and on.tracing.sample_ratio == 1.0
    with pytest.raises(ConfigError, match="endpoint"):
        parse_gateway_config({"backends": BACKENDS, "tracing": {"endpoint": "http://x"}})
    with pytest.raises(ConfigError, match="sample_ratio"):
        parse_gateway_config({"backends": BACKENDS, "tracing": {"sample_ratio": 2.0}})


def test_off_installs_no_middleware_on_installs_one() -> None:
    app = create_gateway_app(parse_gateway_config({"backends": BACKENDS}))
    assert [m.__name__ for m in app.middlewares if m.__name__ == "trace_request"] == []
    on = create_gateway_app(
        parse_gateway_config({"backends": BACKENDS, "tracing": {"enabled": True}})
    )
    assert [m.__name__ for m in on.middlewares if m.__name__ == "trace_request"] == [
        "trace_request"
    ]


def test_missing_extra_is_a_config_error_that_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http", None)
    cfg = parse_gateway_config({"backends": BACKENDS, "tracing": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"pip install 'kiloserve\[tracing\]'"):
        create_gateway_app(cfg)


def test_twin_accepts_otlp_traces_endpoint_like_vllm() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0"]
    url = "http://127.0.0.1:4318/v1/traces"
    args = parser.parse_args([*base, "--otlp-traces-endpoint", url])
    assert config_from_args(args).otlp_traces_endpoint == url
    assert config_from_args(parser.parse_args(base)).otlp_traces_endpoint is None
