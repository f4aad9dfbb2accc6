"""Admin API under ``/admin/``: backend state, drain / undrain, effective config.

Protected by a bearer token when ``admin_token`` (or ``KILOSERVE_ADMIN_TOKEN``) is set
(else 401); without a token only loopback clients (127.0.0.0/8, ::1) may call it (else
403). Errors are raised and answered by the gateway's middleware (``gateway/errors.py``).

* ``GET  /admin/backends``               live state and weights of every backend
* ``POST /admin/backends/{name}/drain``   stop routing new requests to a backend
* ``POST /admin/backends/{name}/undrain`` route to it again
* ``GET  /admin/config``                  the effective config, secrets redacted

Both GET answers carry ``"deployment": {"version", "config_hash"}`` (S5.5): the
kiloserve version and a hash of the effective config (the same values as the
``kiloserve_gateway_info`` metric); each backend row names its models, version and GPU.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from kiloserve import __version__
from kiloserve.errors import ForbiddenError, UnauthorizedError
from kiloserve.gateway.config import GatewayConfig
from kiloserve.routing.table import BackendTable

__all__ = ["add_admin_routes", "config_hash", "deployment_record", "is_loopback"]

_Handler = Callable[[web.Request], Awaitable[web.Response]]


def is_loopback(remote: str | None) -> bool:
    """True for 127.0.0.0/8 and ::1 (and IPv4-mapped loopback)."""
    if not remote:
        return False
    try:
        addr = ipaddress.ip_address(remote)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def config_hash(cfg: GatewayConfig) -> str:
    """16 hex digits of the SHA-256 of the effective config (secrets redacted, keys sorted)."""
    canonical = orjson.dumps(cfg.redacted(), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()[:16]


def deployment_record(cfg: GatewayConfig) -> dict[str, str]:
    """The gateway's version and config hash (S5.5)."""
    return {"version": __version__, "config_hash": config_hash(cfg)}


def _guard(token: str | None, handler: _Handler) -> _Handler:
    async def guarded(request: web.Request) -> web.Response:
        if token is None:
            if not is_loopback(request.remote):
                raise ForbiddenError("admin API is loopback-only without a token")
        else:
            given = request.headers.get("authorization", "")
            expected = f"Bearer {token}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                raise UnauthorizedError("missing or wrong admin bearer token")
        return await handler(request)

    return guarded


def _json(data: object) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def add_admin_routes(
    app: web.Application, cfg: GatewayConfig, table: BackendTable, policy_name: str
) -> None:
    """Register the ``/admin/`` routes on ``app``."""
    token = cfg.effective_admin_token()
    deployment = deployment_record(cfg)

    async def backends(request: web.Request) -> web.Response:
        rows = table.describe(time.monotonic())
        return _json({"policy": policy_name, "deployment": deployment, "backends": rows})

    async def config(request: web.Request) -> web.Response:
        return _json({**cfg.redacted(), "deployment": deployment})

    def drain_handler(draining: bool) -> _Handler:
        async def handler(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            table.set_draining(name, draining)  # NotFoundError (404) for an unknown backend
            return _json({"name": name, "draining": draining})

        return handler

    app.router.add_get("/admin/backends", _guard(token, backends))
    app.router.add_get("/admin/config", _guard(token, config))
    app.router.add_post("/admin/backends/{name:.+}/drain", _guard(token, drain_handler(True)))
    app.router.add_post("/admin/backends/{name:.+}/undrain", _guard(token, drain_handler(False)))
