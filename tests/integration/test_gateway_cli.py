"""``kiloserve gateway`` as a real process, and config loading errors."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from test_gateway_fakes import FakeBackend, fake_backends

from kiloserve.errors import ConfigError
from kiloserve.gateway.cli import add_arguments, build_config
from kiloserve.gateway.config import load_gateway_config

GOOD_YAML = """
port: 0
policy: {name: least_request, params: {}}
scrape_interval_s: 0.1
admin_token: hunter2
models:
  m: {}
backends:
  - {url: "http://127.0.0.1:9001", name: a, models: [m], gpu: H100, group: r1, cost_per_hour: 2.5}
  - {url: "http://127.0.0.1:9002", engine: sglang}
"""


def test_load_gateway_config(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(GOOD_YAML)
    cfg = load_gateway_config(path)
    assert cfg.policy.name == "least_request" and cfg.retries == 2 and cfg.block_size == 16
    assert [b.backend_id for b in cfg.backends] == ["a", "http://127.0.0.1:9002"]
    assert cfg.redacted()["admin_token"] == "***"


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("scrape_intervl_s: 1\n", ["scrape_intervl_s", "scrape_interval_s"]),
        ("backends: [{url: 'http://x', gpuu: H1}]\n", ["backends.0.gpuu", "cost_per_hour"]),
        ("policy: {nam: x}\n", ["policy.nam", "params"]),
        ("retries: -1\n", ["retries"]),
        ("backends: [{url: 'http://a:1'}, {url: 'http://a:1'}]\n", ["duplicate"]),
        ("backends: [{url: 'https://a:1'}]\n", ["backends.0.url", "https"]),
        ("- a\n", ["mapping"]),
        ("a: [\n", ["invalid YAML"]),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_gateway_config(path)
    for needle in needles:
        assert needle in str(info.value)


def test_flags_override_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(GOOD_YAML)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["-c", str(path), "--backend", "http://h:1", "--policy", "random", "--port", "9"]
    )
    cfg = build_config(args)
    assert cfg.port == 9 and cfg.policy.name == "random" and len(cfg.backends) == 3
    assert cfg.backends[2].backend_id == "http://h:1" and cfg.backends[2].models == []


async def test_cli_process_quick_start_and_clean_exit() -> None:
    async with fake_backends(FakeBackend(models=["m1"])) as (fake,):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kiloserve", "gateway", "--backend", fake.url,
            "--policy", "round_robin", "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            url = line.strip().rsplit(" ", 1)[-1]
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            async with aiohttp.ClientSession() as s:
                for _ in range(200):
                    async with s.get(url + "/ready") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.02)
                async with s.post(url + "/v1/completions", json={"model": "m1"}) as r:
                    assert r.status == 200
                    assert r.headers["x-kiloserve-backend"] == fake.url
        finally:
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_cli_bad_policy_exits_2(workers: str) -> None:
    """One process or ``--workers 2`` alike: exit 2 and one error line naming the policy
    (with workers, before: a traceback from each worker and exit 1)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiloserve", "gateway", "--policy", "nope", "--port", "0",
        "--workers", workers, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"kiloserve gateway: error: unknown policy 'nope'" in err
    assert b"Traceback" not in err and err.count(b"error:") == 1, err.decode()


def test_public_surface() -> None:
    import kiloserve.gateway as gateway

    assert sorted(gateway.__all__) == [
        "GatewayConfig",
        "create_gateway_app",
        "load_gateway_config",
        "parse_gateway_config",
    ]
    assert all(callable(getattr(gateway, name)) for name in gateway.__all__)
