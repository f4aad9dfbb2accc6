"""The gateway's ``GET /v1/models``: one card per served model, with vLLM's fields.

vLLM's cards carry ``root`` (the weights behind the served name), ``parent`` (the base
model of a LoRA adapter, else ``null``) and ``max_model_len``; clients read them
(``vllm bench serve`` takes ``root`` as its tokenizer when not given ``--model``, and
stops with ``KeyError: 'root'`` without it). So the gateway asks every backend of each
model for its own ``/v1/models`` (in parallel, ``timeout_s`` each) and merges:

* ``root``: from the first backend (in table order) whose card names the model;
  ``parent``: the first one that is not ``null``; ``max_model_len``: the smallest
  among them (a request must fit wherever it is routed);
* a model no backend answered for: ``root`` is the model name, ``parent`` ``null``,
  and no ``max_model_len`` (unknown).

``merge_cards`` is pure; ``model_cards`` is the only I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import orjson

from kiloserve.routing.table import BackendTable

__all__ = ["merge_cards", "model_cards"]

_CARD_KEYS = ("root", "parent", "max_model_len")


def _cards_by_id(data: Any) -> dict[str, dict[str, Any]]:
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return {}
    return {c["id"]: c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)}


def _max_len(card: Mapping[str, Any]) -> int | None:
    value = card.get("max_model_len")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value > 0 else None


def merge_cards(model: str, backend_cards: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The gateway's card for ``model`` from the cards its backends gave for it."""
    card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kiloserve"}
    found = list(backend_cards)
    card["root"] = next((c["root"] for c in found if isinstance(c.get("root"), str)), model)
    card["parent"] = next((c["parent"] for c in found if isinstance(c.get("parent"), str)), None)
    lengths = [n for n in map(_max_len, found) if n is not None]
    if lengths:
        card["max_model_len"] = min(lengths)
    return card


async def _fetch(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> dict[str, dict[str, Any]]:
    try:
        async with asyncio.timeout(timeout_s), session.get(url + "/v1/models") as resp:
            if resp.status != 200:
                return {}
            return _cards_by_id(await resp.json(loads=orjson.loads, content_type=None))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return {}


async def model_cards(
    session: aiohttp.ClientSession, table: BackendTable, timeout_s: float
) -> list[dict[str, Any]]:
    """One merged card per model the gateway serves (``served_models`` order)."""
    models = table.served_models()
    ids = sorted({b for m in models for b in table.pool_ids(m)}, key=table.backend_ids().index)
    fetched = await asyncio.gather(*(_fetch(session, table.url_of(b), timeout_s) for b in ids))
    by_backend = dict(zip(ids, fetched, strict=True))
    out = []
    for model in models:
        pool = table.pool_ids(model)
        cards = [by_backend[b][model] for b in ids if b in pool and model in by_backend[b]]
        out.append(merge_cards(model, cards))
    return out
