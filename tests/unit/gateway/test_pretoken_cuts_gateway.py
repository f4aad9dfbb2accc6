"""The exact tokenizer's piece cache as the gateway shows it: ``/admin/config``
``tokenizer_piece_cache`` and the gauge ``kiloserve_tokenizer_piece_cache``, on at
start and off after the runtime self-check catches a tokenizer that breaks the cut
rule (a real gateway on 127.0.0.1, port 0; requests go through its front door)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from test_pretoken_cuts import _trap

from kiloserve.gateway.app import CTX_KEY, create_gateway_app, make_runner
from kiloserve.gateway.config import parse_gateway_config

pytest.importorskip("tokenizers")


async def test_admin_config_and_metric_show_the_cache_turning_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _trap().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    cfg = parse_gateway_config({
        "models": {"trap": {"tokenizer": str(tmp_path / "tokenizer.json"),
                            "tokenizer_self_check_every": 1}},  # every cut prompt
        "backends": [{"url": "http://127.0.0.1:9", "models": ["trap"]}],
        "health": {"enabled": False},
    })  # fmt: skip
    app = create_gateway_app(cfg)
    exact = app[CTX_KEY].profiler.exact_tokenizer("trap")
    assert exact is not None and exact.self_check_every == 1
    runner = make_runner(app, cfg)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as session:

            async def state() -> tuple[dict[str, object], str]:
                async with session.get(url + "/admin/config") as resp:
                    config = await resp.json()
                async with session.get(url + "/metrics") as resp:
                    text = await resp.text()
                line = next(x for x in text.splitlines() if x.startswith(
                    'kiloserve_tokenizer_piece_cache{model="trap"}'))  # fmt: skip
                return config["tokenizer_piece_cache"]["trap"], line.split()[-1]

            before, gauge = await state()
            assert before["state"] == "on" and before["cut_rule"] == "newline-before+space"
            assert gauge == "1.0"
            fine = {"model": "trap", "prompt": "tenant prompt\nand more words " * 200}
            async with session.post(url + "/v1/completions", json=fine) as resp:
                await resp.read()  # no backend answers: only the profile matters here
            assert (await state())[0]["state"] == "on"
            # the first place to cut after 1,024 characters is inside "@@ qzx"
            trap = {"model": "trap", "prompt": "x" * 1100 + "@@ qzx and more" * 50}
            with caplog.at_level(logging.WARNING, logger="kiloserve.gateway.exact_tokens"):
                async with session.post(url + "/v1/completions", json=trap) as resp:
                    await resp.read()
            after, gauge = await state()
            assert after["state"] == "off" and "self-check mismatch" in str(after["disabled"])
            assert after["self_checks"] == 2 and gauge == "0.0"
            assert any("model trap" in r.getMessage() for r in caplog.records)
    finally:
        await runner.cleanup()
