"""Node health from a dcgm-exporter page (S3.3), instead of NVML.

``kiloserve agent --dcgm-url URL`` reads the node's dcgm-exporter (or a twin's
``/node/metrics``) every interval. The page is parsed by the gateway's own parser
(``routing/node_metrics.py``) and handed to ``health_score`` in NVML's form (one entry
for the node: the hottest GPU in whole degrees, the summed ECC errors, the last Xid,
whether NVLink counts CRC errors). Only these coarse values go into the registry
record, so it is rewritten when health changes, not on every load change (the gateway
reads PCIe load from the same page itself: the record's ``node_metrics_url``). An
unreachable page is ``None`` (engine ``/health`` alone decides), as a node without
NVML.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from kiloserve.routing.node_metrics import NodeMetrics, parse_node_metrics

__all__ = ["node_health", "read_dcgm"]

logger = logging.getLogger(__name__)


def node_health(node: NodeMetrics) -> dict[str, Any]:
    """The node in the agent's NVML form (``{"gpus": [...]}``; ``health_score`` reads it)."""
    temp = node.temperature_c
    gpu = {
        "index": "all",
        "num_gpus": node.num_gpus,
        "temperature_c": None if temp is None else int(temp),
        "ecc_uncorrected": node.ecc_dbe_errors or 0,
        "xid_events": 1 if node.xid else 0,
        "xid": node.xid or 0,
        "has_nvlink_errors": bool(node.nvlink_crc_errors),
    }
    return {"source": "dcgm", "gpus": [gpu]}


async def read_dcgm(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> dict[str, Any] | None:
    """The node's health from its dcgm-exporter page, or ``None`` when unreadable."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            text = await resp.text()
            if resp.status >= 400:
                logger.warning("dcgm-exporter %s answered %d", url, resp.status)
                return None
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        logger.warning("dcgm-exporter %s unreachable: %s", url, type(exc).__name__)
        return None
    return node_health(parse_node_metrics(text))
