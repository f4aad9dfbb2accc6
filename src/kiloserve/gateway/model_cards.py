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

``merge_cards`` is pure; ``model_cards`` is the only I/O. ``ModelCardCache`` keeps the
merged list for ``model_cards_ttl_s`` so that clients polling ``/v1/models`` (``vllm
bench``, SDKs, health checkers) do not multiply into a request per backend each: one
fetch per backend per TTL, shared by the listings that arrive while it runs, and a new
fetch at once when the membership changes (a backend added, removed or moved to another
URL, a model or LoRA adapter gained or lost by a pool).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import aiohttp
import orjson

from kiloserve.routing.table import BackendTable

__all__ = ["ModelCardCache", "membership", "merge_cards", "model_cards"]

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


def membership(table: BackendTable) -> Hashable:
    """What the cards depend on besides the backends' answers: each model's pool and
    each backend's URL (equal values: the cached cards still describe the table)."""
    pools = tuple((m, table.pool_ids(m)) for m in table.served_models())
    return pools, tuple((b, table.url_of(b)) for b in table.backend_ids())


class ModelCardCache:
    """The merged cards of ``model_cards``, reused for ``ttl_s`` while the table's
    ``membership`` is unchanged; listings that arrive during a fetch share it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.num_fetches = 0  # rounds of backend requests (one per backend each)
        self._cards: list[dict[str, Any]] = []
        self._key: Hashable = None
        self._expires_s = float("-inf")
        self._pending: asyncio.Task[list[dict[str, Any]]] | None = None
        self._pending_key: Hashable = None

    async def get(
        self, session: aiohttp.ClientSession, table: BackendTable, timeout_s: float, ttl_s: float
    ) -> list[dict[str, Any]]:
        """The cards, fetched again when older than ``ttl_s`` (0: every call) or when
        the membership changed since they were fetched."""
        key = membership(table)
        if key == self._key and self.clock() < self._expires_s:
            return self._cards
        task = self._pending
        if task is None or key != self._pending_key:
            self.num_fetches += 1
            task = asyncio.ensure_future(model_cards(session, table, timeout_s))
            self._pending, self._pending_key = task, key
            task.add_done_callback(lambda t: self._done(t, key, ttl_s))
        # shielded: a client that goes away does not cancel the others' fetch
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Task[list[dict[str, Any]]], key: Hashable, ttl_s: float) -> None:
        if self._pending is task:
            self._pending = None
        if task.cancelled() or task.exception() is not None:
            return
        self._cards, self._key = task.result(), key
        self._expires_s = self.clock() + ttl_s
