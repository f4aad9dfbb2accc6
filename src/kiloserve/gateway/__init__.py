"""The load-aware OpenAI-compatible gateway (see docs/gateway.md).

Public surface: ``create_gateway_app(cfg)`` (in ``app``), ``GatewayConfig``,
``load_gateway_config`` and ``parse_gateway_config`` (in ``config``). This file imports
nothing eagerly: ``from kiloserve.gateway import X`` loads X's module on first use, so
``kiloserve.gateway.config`` stays free of aiohttp. One idea per module:

* ``config``: the YAML schema (pydantic; loads no HTTP stack)
* ``app``: the application factory and the front-door handlers
* ``errors``: the error middleware (any ``kiloserve.errors.RequestError`` -> JSON answer)
* ``proxy``: dispatch, retries before the first byte, stream relay, accounting
* ``headers``: header pass-through both ways (hop-by-hop and the gateway's own dropped)
* ``migrate``: mid-stream failover: which streams may move, the rewritten request, splicing
* ``stall``: the per-stream stall watchdog
* ``limits``: ``make_runner``: request-head timeout, connection cap, body budget
* ``upstream``: the lean HTTP/1.1 keep-alive client of the hot path
* ``sse``: server-sent-event framing, the usage chunk
* ``profile``: the request profile a policy sees
* ``scrape``: the per-backend ``/metrics`` scrape loop
* ``kvevents``: the per-backend KV-event subscriptions (ZMQ) feeding the exact prefix index
* ``metrics``: the gateway's Prometheus metrics
* ``admin``: the ``/admin/`` API (backends, drain / undrain, config)
* ``dashboard``: the live dashboard page and its JSON
* ``dashboard_state``: the dashboard's ring buffers and its config
* ``cli``: ``kiloserve gateway``
* ``admission/``: who may send what, how fast, and when (docs/admission.md)
  * ``auth``: API keys (401 / 403)
  * ``ratelimit``: per-key token buckets, in-process or in Redis (429)
  * ``queue``: the ``admission`` config and the pure per-pool queue (lanes, priorities)
  * ``capacity``: pure per-backend capacity (memory need, KV budget, in-flight caps)
  * ``controller``: the live ``AdmissionController`` (queues, reservations, release)
  * ``gate``: the per-request gate: key, input limits, rate limit, admission queue
* ``resilience/``: fault tolerance (docs/fault-tolerance.md)
  * ``health``: the ``health`` config and the probe verdicts (pure)
  * ``prober``: the active probe loops
  * ``outlier``: passive outlier detection and the circuit breaker (pure)
  * ``demotion``: slow-node demotion and slow start (pure)
  * ``manager``: ``Resilience``, the glue into the backend table
* ``registry/``: backends from etcd (the static YAML list is the default)
  * ``settings``: the ``registry`` config section
  * ``record``: the JSON record an agent stores per backend
  * ``etcd``: a small etcd v3 client over its JSON gateway
  * ``watch``: follow the registry prefix into the live backend table
* ``static/``: the dashboard's page, script and style

The live backend table and the router are ``kiloserve.routing`` (shared with the
simulator); the error classes are ``kiloserve.errors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiloserve.lazy import lazy_exports

if TYPE_CHECKING:
    from kiloserve.gateway.app import create_gateway_app
    from kiloserve.gateway.config import GatewayConfig, load_gateway_config, parse_gateway_config

__all__ = ["GatewayConfig", "create_gateway_app", "load_gateway_config", "parse_gateway_config"]

_HOMES = {
    "GatewayConfig": "kiloserve.gateway.config",
    "create_gateway_app": "kiloserve.gateway.app",
    "load_gateway_config": "kiloserve.gateway.config",
    "parse_gateway_config": "kiloserve.gateway.config",
}
__getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)
