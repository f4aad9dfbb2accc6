"""A node's dcgm-exporter page -> ``NodeMetrics`` and its health verdict (no I/O).

A backend entry's ``node_metrics_url`` names the page (a real dcgm-exporter, or a
twin's ``/node/metrics``); the gateway's scrape loop fetches it beside the engine's
``/metrics``. Several GPUs (one series per ``gpu`` label) combine to the worst one:

* ``pcie_util`` <- max over GPUs and directions of ``DCGM_FI_PROF_PCIE_{TX,RX}_BYTES``
  (bytes/s), else ``DCGM_FI_DEV_PCIE_{TX,RX}_THROUGHPUT`` (KB/s, x 1e3), divided by
  ``PCIE_PEAK_BYTES_S``, clipped to [0, 1]: the seed weight's ``1 - pcie_util``;
* ``temperature_c`` <- max ``DCGM_FI_DEV_GPU_TEMP``; ``sm_clock_mhz`` <- min
  ``DCGM_FI_DEV_SM_CLOCK``;
* ``xid`` <- max ``DCGM_FI_DEV_XID_ERRORS`` (the last Xid; 0 none);
* ``ecc_dbe_errors`` <- sum ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``;
* ``nvlink_crc_errors`` <- sum ``DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL``.

``node_problems`` is the verdict the gateway acts on: an Xid, an uncorrectable (double
bit) ECC error or a temperature at or above ``MAX_TEMPERATURE_C`` holds the backend
unhealthy (the table's ``node`` veto: no new requests, in-flight ones finish) until
the page is clean again. NVLink CRC errors are shown, not acted on (a degraded link
slows a TP group, it does not corrupt results).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.routing.engine_metrics import PCIE_PEAK_BYTES_S, parse_samples

__all__ = ["MAX_TEMPERATURE_C", "NodeMetrics", "node_problems", "parse_node_metrics"]

MAX_TEMPERATURE_C = 90.0  # the node agent's threshold too (agent/nvml.py)
_BYTES = ("DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES")
_KB_S = ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "DCGM_FI_DEV_PCIE_RX_THROUGHPUT")


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    """A node's hardware signals; ``None``: the page did not carry the series."""

    num_gpus: int = 0
    pcie_util: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    xid: int | None = None
    ecc_dbe_errors: int | None = None
    nvlink_crc_errors: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "num_gpus": self.num_gpus,
            "pcie_util": self.pcie_util,
            "temperature_c": self.temperature_c,
            "sm_clock_mhz": self.sm_clock_mhz,
            "xid": self.xid,
            "ecc_dbe_errors": self.ecc_dbe_errors,
            "nvlink_crc_errors": self.nvlink_crc_errors,
        }


def _values(samples: list[tuple[str, dict[str, str], float]], *names: str) -> list[float]:
    return [v for n, _, v in samples if n in names and v == v]  # NaN dropped


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _pcie_bytes_s(samples: list[tuple[str, dict[str, str], float]]) -> float | None:
    in_bytes = _max(_values(samples, *_BYTES))
    if in_bytes is not None:
        return in_bytes
    in_kb_s = _max(_values(samples, *_KB_S))
    return None if in_kb_s is None else in_kb_s * 1e3


def parse_node_metrics(text: str) -> NodeMetrics:
    """Parse a dcgm-exporter (or twin ``/node/metrics``) page."""
    samples = parse_samples(text)
    gpus = {labels.get("gpu", "") for name, labels, _ in samples if name.startswith("DCGM_")}
    pcie = _pcie_bytes_s(samples)
    clocks = _values(samples, "DCGM_FI_DEV_SM_CLOCK")
    ecc = _values(samples, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")
    crc = _values(samples, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL")
    return NodeMetrics(
        num_gpus=len(gpus),
        pcie_util=None if pcie is None else min(1.0, max(0.0, pcie / PCIE_PEAK_BYTES_S)),
        temperature_c=_max(_values(samples, "DCGM_FI_DEV_GPU_TEMP")),
        sm_clock_mhz=min(clocks) if clocks else None,
        xid=_int(_max(_values(samples, "DCGM_FI_DEV_XID_ERRORS"))),
        ecc_dbe_errors=_int(sum(ecc)) if ecc else None,
        nvlink_crc_errors=_int(sum(crc)) if crc else None,
    )


def node_problems(node: NodeMetrics, max_temperature_c: float = MAX_TEMPERATURE_C) -> list[str]:
    """Why this node must take no new requests (empty: healthy)."""
    out = []
    if node.xid:
        out.append(f"xid {node.xid}")
    if node.ecc_dbe_errors:
        out.append(f"{node.ecc_dbe_errors} uncorrectable ECC errors")
    temp = node.temperature_c
    if temp is not None and temp >= max_temperature_c:
        out.append(f"temperature {temp:g} C")
    return out
