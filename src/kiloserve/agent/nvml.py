"""Node health from NVML (S3.3): GPU temperature, ECC and Xid counts -> a health score.

``health_score`` also scores a dcgm-exporter page (``agent/dcgm.py``, ``--dcgm-url``),
the only source of Xid events: NVML reports them through an event set this reader
does not keep, so ``read_nvml`` leaves ``xid_events`` at 0.

``pynvml`` is optional: when it is missing (or no driver answers) ``read_nvml`` returns
None and the agent reports ``"nvml": null`` (engine /health alone decides). Scoring is
pure so it can be tested without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["HOT_SCORE", "MAX_TEMPERATURE_C", "NVLINK_SCORE", "health_score", "read_nvml"]

logger = logging.getLogger(__name__)

MAX_TEMPERATURE_C = 90.0  # the gateway's node threshold too (routing/node_metrics.py)
HOT_SCORE = 0.25  # below the agent's min_health_score (0.5): an overheated GPU drains
NVLINK_SCORE = 0.75  # NVLink CRC errors: a degraded link, reported but not drained


def health_score(nvml: dict[str, Any] | None) -> float:
    """1.0 healthy .. 0.0 drain: uncorrected ECC errors or Xid events score 0, a GPU at
    or above ``MAX_TEMPERATURE_C`` ``HOT_SCORE``, NVLink CRC errors ``NVLINK_SCORE``."""
    if not nvml:
        return 1.0
    score = 1.0
    for gpu in nvml.get("gpus", []):
        if gpu.get("ecc_uncorrected", 0) or gpu.get("xid_events", 0):
            return 0.0
        temp = gpu.get("temperature_c")
        if isinstance(temp, (int, float)) and temp >= MAX_TEMPERATURE_C:
            score = min(score, HOT_SCORE)
        if gpu.get("has_nvlink_errors"):
            score = min(score, NVLINK_SCORE)
    return score


def _one_gpu(pynvml: Any, index: int) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    out: dict[str, Any] = {"index": index}
    out["temperature_c"] = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    try:
        out["ecc_uncorrected"] = pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        )
    except pynvml.NVMLError:  # ECC not supported on this board
        out["ecc_uncorrected"] = 0
    out["xid_events"] = 0  # Xid needs an NVML event set; counted by the driver log only
    return out


def read_nvml() -> dict[str, Any] | None:
    """Per-GPU temperature / ECC counts, or None when NVML is not available."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver on this node
        logger.info("NVML unavailable: %s", exc)
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        return {"gpus": [_one_gpu(pynvml, i) for i in range(count)]}
    finally:
        pynvml.nvmlShutdown()
