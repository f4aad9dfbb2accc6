"""The twin's LoRA HTTP surface: vLLM's adapter endpoints and the per-request hooks.

``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` exist only with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, as in vLLM; they
answer ``200`` with vLLM's plain-text success line, ``400`` / ``404`` with its
messages (``engine/lora.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from kiloserve.engine.http_body import read_json_object
from kiloserve.engine.lora import LoraRegistry
from kiloserve.engine.twin import RequestStream, Twin
from kiloserve.errors import RequestError

__all__ = ["adapter_of", "add_lora_routes", "end_lora_request", "start_lora_request"]


def adapter_of(twin: Twin, model: str | None) -> str | None:
    """The adapter a request's ``model`` names, or ``None`` (the base model)."""
    if twin.lora is None or model is None or model == twin.model_name:
        return None
    return model if model in twin.lora.adapters else None


def start_lora_request(twin: Twin, model: str | None) -> Callable[[RequestStream], None]:
    """Charge the adapter's swap to the next step; return the tracker for the stream."""
    name = adapter_of(twin, model)
    lora = twin.lora
    if name is None or lora is None:
        return lambda _stream: None
    twin.loop.pending_swap_s += lora.swap_cost_s(name)
    return lambda stream: lora.track(name, stream)


def end_lora_request(twin: Twin, stream: RequestStream) -> None:
    if twin.lora is not None:
        twin.lora.untrack(stream)


def add_lora_routes(app: web.Application, twin: Twin) -> None:
    """Register the runtime adapter endpoints when the twin allows them."""
    lora = twin.lora
    if lora is None or not twin.config.allow_runtime_lora_updating:
        return
    app.router.add_post("/v1/load_lora_adapter", _handler(lora, is_load=True))
    app.router.add_post("/v1/unload_lora_adapter", _handler(lora, is_load=False))


def _handler(
    lora: LoraRegistry, *, is_load: bool
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        body = await read_json_object(request)
        try:
            if is_load:
                text = lora.load(body.get("lora_name"), body.get("lora_path"))
            else:
                text = lora.unload(body.get("lora_name"))
        except RequestError as exc:  # vLLM's types: InvalidUserInput (400), NotFoundError
            err_type = "NotFoundError" if exc.status == 404 else "InvalidUserInput"
            body_bytes = orjson.dumps(exc.to_body(err_type))
            return web.Response(body=body_bytes, status=exc.status, content_type="application/json")
        return web.Response(text=text)

    return handle
