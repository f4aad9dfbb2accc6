"""Admin API under ``/admin/``: backend state, drain / undrain, effective config.

Protected by a bearer token when ``admin_token`` (or ``KILOSERVE_ADMIN_TOKEN``) is set
(else 401); without a token only loopback clients (127.0.0.0/8, ::1) may call it (else
403). Whoever calls, the operator's browser cannot be turned against it
(``kiloserve.httpguard``): a ``Host`` other than an IP address, localhost, the bound
host or a name in ``admin_allowed_hosts`` is 403 (DNS rebinding), so is a cross-origin
``Origin`` or ``Sec-Fetch-Site: cross-site`` (CSRF), and a write (POST) with a body that
is not ``application/json`` is 400. Errors are raised and answered by the gateway's
middleware (``gateway/errors.py``).

* ``GET  /admin/backends``               live state and weights of every backend
* ``POST /admin/backends/{name}/drain``   stop routing new requests to a backend
* ``POST /admin/backends/{name}/undrain`` route to it again; both take an optional JSON
  body ``{"move_id": UUID, "expected_version": N}`` (S3.5, ``registry/moves.py``): a
  repeated ``move_id`` is a no-op, a stale ``expected_version`` a 409; the answer
  carries ``applied`` and the backend's move ``version``
* ``POST /admin/reload``                  reload the config file (``gateway/reload.py``)
* ``GET  /admin/config``                  the effective config, secrets redacted, plus
  ``kv_events`` (per publishing backend: mode, endpoints, counters, blocks;
  docs/kv-events.md), ``tokenizer_modes`` (model -> exact / approximate) and
  ``tokenizer_piece_cache`` (per exact model: its piece cache, ``ExactTokenizer.describe``)

Both GET answers carry ``"deployment": {"version", "config_hash"}`` (S5.5): the
kiloserve version and a hash of the effective config (the same values as the
``kiloserve_gateway_info`` metric); each backend row names its models, version and GPU,
and the engine's kind, version, model root and context length (``gateway/inventory.py``).

``add_admin_routes`` also guards ``GET /metrics`` with ``metrics_token`` when one is
set, and warns once when the gateway binds a non-loopback address with neither API
keys nor an admin token.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kiloserve import __version__
from kiloserve.errors import ForbiddenError, RequestError
from kiloserve.gateway.config import GatewayConfig
from kiloserve.gateway.registry.moves import MoveLedger, parse_move
from kiloserve.httpguard import HostPolicy, check_bearer, check_browser_request, is_loopback_host
from kiloserve.routing.table import BackendTable

__all__ = [
    "LIVE_CONFIG_KEY",
    "LiveConfig",
    "add_admin_routes",
    "check_browser",
    "config_hash",
    "deployment_record",
    "host_policy",
    "is_loopback",
]

logger = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.Response]]


@dataclass(slots=True)
class LiveConfig:
    """The config the gateway runs now and its policy's name; a reload swaps them and
    sets ``reload`` (``gateway/reload.py``), which ``POST /admin/reload`` calls."""

    cfg: GatewayConfig
    policy_name: str
    reload: Callable[[], Awaitable[dict[str, Any]]] | None = None


LIVE_CONFIG_KEY = web.AppKey("kiloserve_gateway_live_config", LiveConfig)


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


def host_policy(cfg: GatewayConfig) -> HostPolicy:
    """The ``Host`` / ``Origin`` names the admin API and the dashboard answer."""
    return HostPolicy.of(cfg.host, cfg.admin_allowed_hosts, "admin_allowed_hosts")


def check_browser(request: web.Request, policy: HostPolicy) -> None:
    """``kiloserve.httpguard.check_browser_request`` on an aiohttp request: 403 for a
    foreign ``Host`` / ``Origin`` or a cross-site fetch, 400 for a non-JSON write."""
    check_browser_request(request.method, request.headers, request.body_exists, policy)


def _guard(token: str | None, policy: HostPolicy, handler: _Handler) -> _Handler:
    async def guarded(request: web.Request) -> web.Response:
        if token is None:
            if not is_loopback(request.remote):
                raise ForbiddenError("admin API is loopback-only without a token")
        else:
            check_bearer(request.headers.get("Authorization"), token)
        check_browser(request, policy)
        return await handler(request)

    return guarded


def _metrics_token_middleware(token: str) -> Middleware:
    """``GET /metrics`` only with ``Authorization: Bearer <metrics_token>`` (401)."""

    @web.middleware
    async def metrics_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/metrics":
            check_bearer(request.headers.get("Authorization"), token)
        return await handler(request)

    return metrics_token


def _warn_if_open(cfg: GatewayConfig, admin_token: str | None) -> None:
    if is_loopback_host(cfg.host) or cfg.auth.keys or admin_token:
        return
    logger.warning(
        "gateway binds %s with no API keys and no admin token: anyone who can reach it may"
        " send requests%s (the admin API stays loopback-only); set auth.keys and"
        " admin_token (docs/admission.md, docs/gateway.md)",
        cfg.host,
        "" if cfg.metrics_token else " and read /metrics",
    )


def _json(data: object) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body; None when it has none (400 when it is not JSON)."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"invalid JSON body: {exc}", code="invalid_json") from exc


def add_admin_routes(
    app: web.Application,
    cfg: GatewayConfig,
    table: BackendTable,
    policy_name: str,
    *,
    kv_events: Callable[[], Mapping[str, Any]] = dict,
    tokenizer_modes: Callable[[], Mapping[str, str]] = dict,
    tokenizer_piece_cache: Callable[[], Mapping[str, Any]] = dict,
) -> None:
    """Register the ``/admin/`` routes on ``app``; with ``metrics_token`` set, guard
    ``/metrics`` (a middleware after the error middleware, so refusals are JSON).
    ``kv_events`` and ``tokenizer_modes`` are read for each ``GET /admin/config``."""
    token = cfg.effective_admin_token()
    policy = host_policy(cfg)
    live = app[LIVE_CONFIG_KEY] = LiveConfig(cfg, policy_name)
    moves = MoveLedger()
    _warn_if_open(cfg, token)
    if cfg.metrics_token:
        app.middlewares.append(_metrics_token_middleware(cfg.metrics_token))

    async def backends(request: web.Request) -> web.Response:
        rows = table.describe(time.monotonic())
        for row in rows:
            row["move_version"] = moves.version(row["name"])
        deployment = deployment_record(live.cfg)
        return _json({"policy": live.policy_name, "deployment": deployment, "backends": rows})

    async def config(request: web.Request) -> web.Response:
        return _json({
            **live.cfg.redacted(),
            "deployment": deployment_record(live.cfg),
            "kv_events": dict(kv_events()),
            "tokenizer_modes": dict(tokenizer_modes()),
            "tokenizer_piece_cache": dict(tokenizer_piece_cache()),
        })  # fmt: skip

    def drain_handler(draining: bool) -> _Handler:
        async def handler(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            table.record(name)  # NotFoundError (404) for an unknown backend
            move_id, expected = parse_move(await _json_body(request))
            result = moves.move(name, move_id, expected, lambda: table.set_draining(name, draining))
            return _json({"name": name, "draining": draining, **result.as_json()})

        return handler

    def guard(handler: _Handler) -> _Handler:
        return _guard(token, policy, handler)

    app.router.add_get("/admin/backends", guard(backends))
    app.router.add_get("/admin/config", guard(config))
    app.router.add_post("/admin/backends/{name:.+}/drain", guard(drain_handler(True)))
    app.router.add_post("/admin/backends/{name:.+}/undrain", guard(drain_handler(False)))

    async def reload(request: web.Request) -> web.Response:
        if live.reload is None:
            raise RequestError("this gateway cannot reload its config", code="reload_unavailable")
        return _json(await live.reload())

    app.router.add_post("/admin/reload", guard(reload))
