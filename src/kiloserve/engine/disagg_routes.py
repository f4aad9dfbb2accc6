"""The twin's HTTP side of disaggregated prefill/decode (vLLM's P/D protocol).

A request body's ``kv_transfer_params`` (``engine/kv_params.py``) makes it a leg:

* **prefill leg** (``do_remote_decode: true``): runs as usual (the proxy sent
  ``max_tokens: 1``); its sequence keeps its KV blocks when it finishes
  (``engine/kv_holds.py``) and the answer's JSON carries the ``kv_transfer_params``
  the decode leg needs: this twin's engine id, the block ids, the address the request
  reached (``remote_host`` / ``remote_port``), ``tp_size``, ``remote_request_id`` (the
  ``X-Request-Id`` header, else a fresh id) and ``num_tokens`` (the prompt's).
* **decode leg** (``do_remote_prefill: true``): first checks that the prefill engine
  still holds the KV (``POST http://remote_host:remote_port/kv_transfer/pull``, the
  twin's stand-in for NIXL's read). When it does not (the hold expired after
  ``--kv-hold-timeout-s``, a decode leg already released it, the prefill engine
  restarted or does not answer) the transfer fails as vLLM's NixlConnector's does:
  counted in ``vllm:nixl_num_failed_transfers`` and the prompt recomputed here (no
  transferred tokens, no release sent). Otherwise it waits the modelled pull of the
  prompt's KV (``TwinPd.transfer_time_s`` of all prompt tokens but the last, over
  ``--kv-link``), then runs with those tokens counted as computed. Once the transfer
  is over (or the leg ends early) it tells the prefill engine to free the blocks:
  ``POST http://remote_host:remote_port/kv_transfer/release`` with
  ``{"request_id", "remote_engine_id"}``, in the background; a failed release is
  logged and counted (``vllm:nixl_num_failed_notifications``), never the client's
  error: the prefill engine's hold timeout frees the blocks anyway.

Routes: ``POST /kv_transfer/release`` (200 ``{"released": true, ...}``; 404 when the
request is not held here, e.g. already expired, or the engine id is not this
twin's), ``POST /kv_transfer/pull`` (the same body and 404s; 200
``{"request_id", "num_blocks"}``, the hold kept until its release or timeout) and
``GET /kv_transfer/info`` (role, engine id, link, held KV).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from kiloserve.engine.http_body import read_json_object
from kiloserve.engine.kv_metrics import KvMetrics
from kiloserve.engine.kv_params import (
    FIELD,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
    prefill_answer,
)
from kiloserve.engine.twin import RequestStream, Twin
from kiloserve.engine.twin_pd import TwinPd
from kiloserve.errors import NotFoundError, RequestError

__all__ = ["PLAIN", "KvReleaser", "Leg", "add_disagg_routes", "leg_of"]

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0
REQUEST_ID_HEADER = "X-Request-Id"
RELEASER_KEY: web.AppKey[KvReleaser] = web.AppKey("kv_releaser")


def _hold_body(params: RemotePrefill) -> dict[str, str]:
    """The body of a pull / release: the held request and its prefill engine."""
    return {"request_id": params.remote_request_id, "remote_engine_id": params.remote_engine_id}


class KvReleaser:
    """A decode leg's calls to its prefill engine: the pull check, and the release (in
    the background)."""

    def __init__(self, metrics: KvMetrics, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, params: RemotePrefill) -> None:
        """Start freeing ``params``' blocks on the prefill engine (returns at once)."""
        task = asyncio.get_running_loop().create_task(self._send(params))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def pull(self, params: RemotePrefill) -> str | None:
        """None when the prefill engine holds ``params``' KV, else why not."""
        try:
            session = self._session_for_calls()
            async with session.post(params.pull_url, json=_hold_body(params)) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if status == 200 else f"HTTP {status}"

    def _session_for_calls(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _send(self, params: RemotePrefill) -> None:
        try:
            session = self._session_for_calls()
            async with session.post(params.release_url, json=_hold_body(params)) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._failed(params, f"{type(exc).__name__}: {exc}")
            return
        if status != 200:
            self._failed(params, f"HTTP {status}")

    def _failed(self, params: RemotePrefill, why: str) -> None:
        logger.warning(
            "request %s: could not release its KV on %s:%d (%s); its hold timeout frees it",
            params.remote_request_id,
            params.remote_host,
            params.remote_port,
            why,
        )
        self._metrics.on_release_failed()

    async def close(self) -> None:
        """Let releases in flight finish (bounded by their timeout), then close."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


@dataclass(slots=True, eq=False)
class Leg:
    """A request's P/D part as ``TwinLoop.submit`` takes it (defaults: a plain request)."""

    hold_request_id: str | None = None  # a prefill leg's id
    num_transferred_tokens: int = 0  # a decode leg's
    transfer_s: float = 0.0
    remote: RemotePrefill | None = None
    _twin: Twin | None = None
    _releaser: KvReleaser | None = None

    @property
    def is_prefill(self) -> bool:
        return self.hold_request_id is not None

    def submitted(self, is_done: bool) -> None:
        """After ``submit`` (``is_done``: the transfer completed): a decode leg counts its
        transfer and frees its prefill's KV (even when it ended early)."""
        if self.remote is None or self._releaser is None or self._twin is None:
            return
        pd = self._twin.pd
        if is_done and pd is not None:
            num_bytes = pd.transfer_bytes(self.num_transferred_tokens)
            self._twin.metrics.kv.on_transfer(self.transfer_s, num_bytes)
        self._releaser.release(self.remote)
        self.remote = None  # once

    def answer(self, body: bytes, stream: RequestStream, request: web.Request) -> bytes:
        """A prefill leg's answer with its ``kv_transfer_params``."""
        twin = self._twin
        if not self.is_prefill or twin is None or twin.pd is None:
            return body
        pd = twin.pd
        request_id = stream.kv_request_id or self.hold_request_id or ""
        held = pd.holds.get(request_id)
        host, port = _bound_address(request, twin)
        data = orjson.loads(body)
        data[FIELD] = prefill_answer(
            engine_id=pd.engine_id,
            block_ids=held.block_ids if held is not None else [],
            host=host,
            port=port,
            tp_size=pd.tp,
            request_id=request_id,
            num_tokens=stream.num_prompt_tokens,
        )
        return orjson.dumps(data)


PLAIN = Leg()


def _bound_address(request: web.Request, twin: Twin) -> tuple[str, int]:
    """The address this request reached (what a decode engine can reach, too)."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0]), int(sockname[1])
    return twin.config.host, twin.config.port


async def leg_of(request: web.Request, twin: Twin, body: object, num_prompt_tokens: int) -> Leg:
    """The request's P/D leg (``PLAIN`` when it is none); a 400 naming a bad field. A
    decode leg whose prefill KV is gone recomputes its prompt (module docstring)."""
    pd = twin.pd
    if pd is None or not isinstance(body, dict):
        return PLAIN
    params = parse_kv_transfer_params(body, pd.role)
    if params is None:
        return PLAIN
    releaser = request.app[RELEASER_KEY]
    if isinstance(params, RemoteDecode):
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"kv-{uuid.uuid4().hex}"
        return Leg(hold_request_id=request_id, _twin=twin, _releaser=releaser)
    why = await releaser.pull(params)
    if why is not None:
        logger.warning(
            "request %s: its KV is not held on %s:%d (%s); recomputing the prompt",
            params.remote_request_id, params.remote_host, params.remote_port, why,
        )  # fmt: skip
        twin.metrics.kv.on_transfer_failed()
        return PLAIN
    num_tokens = params.num_transferred_tokens(num_prompt_tokens)
    return Leg(
        num_transferred_tokens=num_tokens,
        transfer_s=pd.transfer_time_s(num_tokens),
        remote=params,
        _twin=twin,
        _releaser=releaser,
    )


def _info(pd: TwinPd, twin: Twin) -> dict[str, object]:
    return {
        "role": pd.role,
        "engine_id": pd.engine_id,
        "model": twin.model_name,
        "tp_size": pd.tp,
        "kv_link": {
            "name": pd.link.name,
            "bandwidth_bps": pd.link.bandwidth_bps,
            "latency_s": pd.link.latency_s,
        },
        "kv_bytes_per_token_per_gpu": pd.kv_bytes_per_token_per_gpu,
        "kv_hold_timeout_s": pd.holds.timeout_s,
        "held_requests": pd.holds.num_held_requests,
        "held_blocks": pd.holds.num_held_blocks,
        "kv_cpu_gib": twin.config.kv_cpu_gib,
        "kv_remote_gib": twin.config.kv_remote_gib,
    }


async def _held_request_id(request: web.Request, pd: TwinPd) -> str:
    """The ``request_id`` of a release / pull body; 400 / 404 naming a bad field."""
    body = await read_json_object(request)
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise RequestError("request_id must be a non-empty string", param="request_id")
    engine_id = body.get("remote_engine_id")
    if engine_id is not None and engine_id != pd.engine_id:
        raise NotFoundError(
            f"remote_engine_id {engine_id!r} is not this engine's (it restarted?)",
            param="remote_engine_id",
        )
    return request_id


def _not_held(request_id: str) -> NotFoundError:
    return NotFoundError(
        f"no KV held for request {request_id!r} (released, expired or never held)",
        param="request_id",
    )


def add_disagg_routes(app: web.Application, twin: Twin) -> None:
    """``POST /kv_transfer/release`` / ``pull``, ``GET /kv_transfer/info`` and the client
    a decode leg calls them with."""
    pd = twin.pd
    if pd is None:
        return
    releaser = KvReleaser(twin.metrics.kv)
    app[RELEASER_KEY] = releaser

    async def release(request: web.Request) -> web.Response:
        request_id = await _held_request_id(request, pd)
        held = pd.holds.release(request_id)
        if held is None:
            raise _not_held(request_id)
        answer = {"released": True, "request_id": request_id, "num_blocks": len(held.block_ids)}
        return web.json_response(answer)

    async def pull(request: web.Request) -> web.Response:
        request_id = await _held_request_id(request, pd)
        held = pd.holds.get(request_id)
        if held is None:
            raise _not_held(request_id)
        return web.json_response({"request_id": request_id, "num_blocks": len(held.block_ids)})

    async def info(request: web.Request) -> web.Response:
        return web.json_response(_info(pd, twin))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        yield
        await releaser.close()
        pd.holds.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/kv_transfer/release", release)
    app.router.add_post("/kv_transfer/pull", pull)
    app.router.add_get("/kv_transfer/info", info)
