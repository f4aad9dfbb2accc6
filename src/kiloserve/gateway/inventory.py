"""Engine software and model versions of every backend (SPEC S5.5): what runs where.

Once a backend is known, and every ``inventory_interval_s`` (60 s) after that, the
gateway asks the engine itself, by its kind (``engine:`` in the config, else the kind
its ``/metrics`` page showed, else the first of these endpoints that answers):

* vLLM (and the twin): ``GET /version`` -> ``version``; ``GET /metrics`` -> the labels
  of ``vllm:cache_config_info`` (block size, cache dtype, GPU blocks, prefix caching);
* SGLang: ``GET /get_server_info`` (its server args) -> ``version``, ``model_path``,
  ``context_length``;
* llama.cpp: ``GET /props`` -> ``build_info``, ``model_path``, ``n_ctx`` (top level or
  in ``default_generation_settings``);
* every engine: ``GET /v1/models`` -> the first card's ``root`` (the weights behind
  the served name) and ``max_model_len``.

The result (``BackendTable.set_inventory``) shows in ``GET /admin/backends``
(``engine_version``, ``model_root``, ``max_model_len``, ``cache_config``) and in the
``kiloserve_backend_info`` metric. A backend that does not answer keeps what was
collected last; one never collected is asked again after ``_RETRY_S``. Parsing is pure
(``parse_*``); the loop is the only I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kiloserve.gateway.config import GatewayConfig
from kiloserve.routing.engine_metrics import parse_samples
from kiloserve.routing.table import BackendTable

__all__ = [
    "collect_inventory",
    "install_inventory",
    "inventory_loop",
    "parse_cache_config",
    "parse_llamacpp_props",
    "parse_models",
    "parse_sglang_server_info",
    "parse_vllm_version",
]

logger = logging.getLogger(__name__)

_RETRY_S = 5.0  # a backend never inventoried is asked again this often
_TICK_S = 1.0
_MAX_LABEL_CHARS = 200  # a label value from a remote engine is clipped to this


def _text(value: Any) -> str:
    return value[:_MAX_LABEL_CHARS] if isinstance(value, str) else ""


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_vllm_version(data: Any) -> str:
    """vLLM's ``GET /version``: ``{"version": "0.8.5"}``."""
    return _text(data.get("version")) if isinstance(data, dict) else ""


def parse_models(data: Any) -> dict[str, Any]:
    """``GET /v1/models``: the first card's ``root`` and ``max_model_len`` (vLLM's)."""
    cards = data.get("data") if isinstance(data, dict) else None
    card = cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else {}
    out: dict[str, Any] = {}
    if root := _text(card.get("root")):
        out["model_root"] = root
    if (max_len := _positive_int(card.get("max_model_len"))) is not None:
        out["max_model_len"] = max_len
    return out


def parse_sglang_server_info(data: Any) -> dict[str, Any]:
    """SGLang's ``GET /get_server_info``: its server args plus ``version``."""
    if not isinstance(data, dict):
        return {}
    out: dict[str, Any] = {"engine": "sglang", "engine_version": _text(data.get("version"))}
    if path := _text(data.get("model_path")):
        out["model_root"] = path
    if (ctx := _positive_int(data.get("context_length"))) is not None:
        out["max_model_len"] = ctx
    return out


def parse_llamacpp_props(data: Any) -> dict[str, Any]:
    """llama.cpp's ``GET /props``: ``build_info``, ``model_path``, ``n_ctx``."""
    if not isinstance(data, dict):
        return {}
    out: dict[str, Any] = {"engine": "llamacpp", "engine_version": _text(data.get("build_info"))}
    if path := _text(data.get("model_path")):
        out["model_root"] = path
    settings = data.get("default_generation_settings")
    n_ctx = data.get("n_ctx")
    if n_ctx is None and isinstance(settings, dict):
        n_ctx = settings.get("n_ctx")
    if (ctx := _positive_int(n_ctx)) is not None:
        out["max_model_len"] = ctx
    return out


def parse_cache_config(text: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` (empty without the series)."""
    for name, labels, _ in parse_samples(text):
        if name == "vllm:cache_config_info":
            return {k: _text(v) for k, v in sorted(labels.items())}
    return {}


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bytes | None:
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            body = await resp.read()
            return body if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    body = await _get(session, url, timeout_s)
    if body is None:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


async def _engine_facts(
    session: aiohttp.ClientSession, url: str, engine: str | None, timeout_s: float
) -> dict[str, Any]:
    """Kind and version from the engine's own endpoint (module docstring's order)."""
    if engine in (None, "vllm"):
        data = await _get_json(session, url + "/version", timeout_s)
        if isinstance(data, dict) and "version" in data:
            return {"engine": "vllm", "engine_version": parse_vllm_version(data)}
    if engine in (None, "sglang"):
        info = await _get_json(session, url + "/get_server_info", timeout_s)
        facts = parse_sglang_server_info(info)
        if facts:
            return facts
    if engine in (None, "llamacpp"):
        facts = parse_llamacpp_props(await _get_json(session, url + "/props", timeout_s))
        if facts:
            return facts
    return {"engine": engine} if engine else {}


async def collect_inventory(
    session: aiohttp.ClientSession, url: str, engine: str | None, timeout_s: float
) -> dict[str, Any] | None:
    """What the backend at ``url`` runs; None when it answered none of the endpoints."""
    facts = await _engine_facts(session, url, engine, timeout_s)
    models = parse_models(await _get_json(session, url + "/v1/models", timeout_s))
    if not facts.get("engine_version") and not models:
        return None
    out = {**models, **facts}  # the engine's own model path wins over /v1/models
    if out.get("engine") == "vllm":
        page = await _get(session, url + "/metrics", timeout_s)
        config = parse_cache_config(page.decode("utf-8", "replace")) if page else {}
        if config:
            out["cache_config"] = config
    return out


def _engine_hint(table: BackendTable, backend_id: str) -> str | None:
    rec = table.record(backend_id)
    if rec.config.engine != "auto":
        return rec.config.engine
    return rec.engine


async def _refresh(
    session: aiohttp.ClientSession,
    table: BackendTable,
    backend_id: str,
    timeout_s: float,
) -> None:
    url = table.url_of(backend_id)
    got = await collect_inventory(session, url, _engine_hint(table, backend_id), timeout_s)
    if got is None:
        logger.info("inventory of backend %s: no engine endpoint answered", backend_id)
        return
    if backend_id in table.backend_ids():
        table.set_inventory(backend_id, got)


def _is_due(
    table: BackendTable, backend_id: str, last: Mapping[str, float], now_s: float, interval_s: float
) -> bool:
    asked = last.get(backend_id)
    if asked is None:
        return True
    inventory = table.record(backend_id).inventory
    if not inventory:
        return now_s - asked >= min(_RETRY_S, interval_s)
    hint = _engine_hint(table, backend_id)
    if hint is not None and hint != inventory.get("engine"):
        return True  # the scrape now shows another engine kind
    return now_s - asked >= interval_s


async def inventory_loop(
    session: aiohttp.ClientSession, table: BackendTable, interval_s: float, timeout_s: float
) -> None:
    """Keep every backend's inventory fresh (cancel the task to stop)."""
    last: dict[str, float] = {}
    while True:
        now_s = time.monotonic()
        ids = set(table.backend_ids())
        due = [b for b in sorted(ids) if _is_due(table, b, last, now_s, interval_s)]
        for b in due:
            last[b] = now_s
        for b in set(last) - ids:
            del last[b]
        try:
            await asyncio.gather(*(_refresh(session, table, b, timeout_s) for b in due))
        except Exception:  # keep going whatever one round did
            logger.exception("backend inventory round failed")
        await asyncio.sleep(_TICK_S)


def install_inventory(app: web.Application, table: BackendTable, cfg: GatewayConfig) -> None:
    """Run ``inventory_loop`` while ``app`` runs (its own small HTTP session); nothing
    when ``inventory_interval_s`` is 0."""
    if cfg.inventory_interval_s <= 0:
        return
    timeout_s = max(cfg.scrape_timeout_s, cfg.connect_timeout_s)

    async def run(_: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=16)
        async with aiohttp.ClientSession(connector=connector) as session:
            task = asyncio.create_task(
                inventory_loop(session, table, cfg.inventory_interval_s, timeout_s)
            )
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(run)
