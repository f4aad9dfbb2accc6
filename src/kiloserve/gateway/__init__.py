"""The load-aware OpenAI-compatible gateway (see docs/gateway.md).

Public surface: ``create_gateway_app(cfg)``, ``GatewayConfig``, ``load_gateway_config``
and ``parse_gateway_config``. Inside, one idea per module: ``config`` (YAML schema),
``app`` (factory and front door), ``proxy`` (dispatch, retries, stream relay),
``upstream`` (lean HTTP/1.1 client), ``sse`` (event framing, usage chunk),
``profile`` (request profile), ``backends`` (live state, health, snapshots),
``scrape`` (engine metric parsers and the scrape loop), ``metrics`` (Prometheus),
``admin`` (admin API), ``cli`` (``kiloserve gateway``).
"""

from __future__ import annotations

from kiloserve.gateway.app import create_gateway_app
from kiloserve.gateway.config import GatewayConfig, load_gateway_config, parse_gateway_config

__all__ = ["GatewayConfig", "create_gateway_app", "load_gateway_config", "parse_gateway_config"]
