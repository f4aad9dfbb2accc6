"""The node agent's health from a dcgm-exporter page (``--dcgm-url``, agent/dcgm.py):
a hot GPU, an Xid or an ECC error drains; the record advertises the page to the gateway."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kiloserve.agent.cli import add_arguments, config_from_args
from kiloserve.agent.loop import Agent, AgentConfig
from kiloserve.agent.nvml import health_score
from kiloserve.errors import ConfigError
from kiloserve.gateway.registry.record import decode_record

_L = 'UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="n1"'


def _page(temp_c: float, xid: int = 0, ecc: int = 0, crc: int = 0) -> str:
    return "\n".join(
        [
            f'DCGM_FI_DEV_GPU_TEMP{{gpu="0",{_L}}} {temp_c}',
            f'DCGM_FI_DEV_XID_ERRORS{{gpu="0",{_L}}} {xid}',
            f'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{gpu="0",{_L}}} {ecc}',
            f'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{gpu="0",{_L}}} {crc}',
        ]
    )


@pytest.fixture
async def exporter() -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A dcgm-exporter stand-in on 127.0.0.1:0 serving ``page["text"]``."""
    page = {"text": _page(60.0)}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/metrics", page
    finally:
        await runner.cleanup()


def test_a_hot_gpu_scores_below_the_drain_threshold() -> None:
    min_score = AgentConfig("http://e:1", [], "n").min_health_score
    assert health_score({"gpus": [{"temperature_c": 95, "ecc_uncorrected": 0}]}) < min_score
    assert health_score({"gpus": [{"temperature_c": 80, "ecc_uncorrected": 0}]}) == 1.0


@pytest.mark.parametrize(
    ("page", "is_draining"),
    [
        (_page(60.0), False),
        (_page(95.0), True),  # overheated
        (_page(60.0, xid=79), True),  # Xid burst
        (_page(60.0, ecc=1), True),  # uncorrectable ECC
        (_page(60.0, crc=12), False),  # degraded NVLink: reported, not drained
    ],
)
async def test_record_drains_on_dcgm_health(
    exporter: tuple[str, dict[str, str]], page: str, is_draining: bool
) -> None:
    url, served = exporter
    served["text"] = page
    cfg = AgentConfig("http://127.0.0.1:1", ["127.0.0.1:1"], "n0", models=["m"], dcgm_url=url)
    async with aiohttp.ClientSession() as session:
        record = decode_record(await Agent(cfg, session)._record(), "k")
    assert record.is_draining is is_draining
    assert record.backend.node_metrics_url == url
    assert record.health is not None and record.health["nvml"]["source"] == "dcgm"


async def test_unreachable_exporter_leaves_the_engine_health_alone() -> None:
    cfg = AgentConfig(
        "http://127.0.0.1:1", ["127.0.0.1:1"], "n0", models=["m"],
        dcgm_url="http://127.0.0.1:1/metrics", timeout_s=0.5,
    )  # fmt: skip
    async with aiohttp.ClientSession() as session:
        record = decode_record(await Agent(cfg, session)._record(), "k")
    assert not record.is_draining and record.health == {"score": 1.0, "nvml": None}


def test_cli_takes_a_dcgm_url() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--engine-url", "http://127.0.0.1:8001", "--etcd", "127.0.0.1:2379"]
    args = parser.parse_args([*base, "--dcgm-url", "http://127.0.0.1:9400/metrics"])
    assert config_from_args(args).dcgm_url == "http://127.0.0.1:9400/metrics"
    with pytest.raises(ConfigError, match="--dcgm-url"):
        config_from_args(parser.parse_args([*base, "--dcgm-url", "ftp://x"]))
