"""The twin's node page: what a dcgm-exporter beside the engine would report (S1.3, S3.3).

``GET /node/metrics`` serves Prometheus text with dcgm-exporter's metric and label
names (labels ``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``; one series
per modelled GPU, ``tp`` of them, all equal). Values come from the twin's model, read
at scrape time over the window since the previous scrape (at least ``MIN_WINDOW_S``):

* utilisation ``u``: the share of the window the engine loop was stepping;
* PCIe (``DCGM_FI_PROF_PCIE_{TX,RX}_BYTES`` in bytes/s, ``DCGM_FI_DEV_PCIE_{TX,RX}_
  THROUGHPUT`` in KB/s as DCGM reports): the KV cache of every newly prefilled token
  crosses the bus once to the host KV tier (TX), every prefix-cache hit's KV comes back
  (RX), plus 4 bytes a prompt token id (RX); the ``pcie_saturation`` fault adds other
  traffic filling that share of ``PCIE_PEAK_BYTES_S`` (both directions, capped at it);
* temperature (``DCGM_FI_DEV_GPU_TEMP``): the thermal fault's model when it is set,
  else ``IDLE_TEMPERATURE_C + u * (LOAD_TEMPERATURE_C - IDLE_TEMPERATURE_C)``;
* SM clock (``DCGM_FI_DEV_SM_CLOCK``, MHz): the GPU's max clock x the thermal clock ratio;
* NVLink (``DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL``, a counter in KB): with ``tp > 1`` the
  links run at full width for ``NVLINK_BUSY_SHARE`` of busy time; at or above the
  ``nvlink_degrade_at_c`` fault's temperature at half width (seed 004: an A100 node
  over 75 C drops NVLink to half bandwidth), which also counts link-retraining
  ``DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL`` errors;
* ``DCGM_FI_DEV_XID_ERRORS`` (the last Xid, 0: none) and
  ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` come from the ``xid`` / ``ecc_dbe_errors`` faults.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kiloserve.catalog.specs import GpuSpec
from kiloserve.engine.faults import FaultInjector
from kiloserve.engine.metrics import EngineStats

__all__ = [
    "IDLE_TEMPERATURE_C",
    "LOAD_TEMPERATURE_C",
    "PCIE_PEAK_BYTES_S",
    "NodeModel",
    "NodeReading",
]

PCIE_PEAK_BYTES_S = 32e9  # PCIe Gen4 x16 per direction (routing.engine_metrics divides by it)
IDLE_TEMPERATURE_C = 35.0
LOAD_TEMPERATURE_C = 70.0
NVLINK_BUSY_SHARE = 0.1
NVLINK_CRC_ERRORS_PER_S = 5.0  # while degraded
MIN_WINDOW_S = 0.05
TOKEN_ID_BYTES = 4
_MAX_SM_CLOCK_MHZ = {
    "H100-SXM": 1980, "H100-PCIe": 1755, "H200": 1980, "A100-80G": 1410, "A100-40G": 1410,
    "L40S": 2520, "A10": 1695, "T4": 1590, "MI300X": 2100,
}  # fmt: skip
DEFAULT_MAX_SM_CLOCK_MHZ = 1800


@dataclass(frozen=True, slots=True)
class NodeReading:
    """One GPU's modelled hardware signals at one instant."""

    temperature_c: float
    sm_clock_mhz: float
    pcie_tx_bytes_s: float
    pcie_rx_bytes_s: float
    nvlink_total_kb: float
    nvlink_crc_errors: float
    xid: int
    ecc_dbe_errors: int


@dataclass(slots=True)
class _Sample:
    t_s: float
    busy_s: float
    queries_tokens: int
    hits_tokens: int


class NodeModel:
    """The node of one twin; ``render()`` is the ``/node/metrics`` page."""

    def __init__(
        self,
        gpu: GpuSpec,
        tp: int,
        kv_bytes_per_token: int,
        stats_fn: Callable[[], EngineStats],
        faults: FaultInjector,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpu, self.tp, self._kv_bytes_per_token = gpu, tp, kv_bytes_per_token
        self._stats_fn, self._faults, self._clock = stats_fn, faults, clock
        self.hostname = socket.gethostname()
        self.uuids = [f"GPU-{uuid.uuid4()}" for _ in range(tp)]
        self._last = self._sample()
        self._nvlink_kb = 0.0
        self._crc_errors = 0.0
        self._reading = self._read(self._last, self._last)

    def _sample(self) -> _Sample:
        s = self._stats_fn()
        busy_s = self._faults.busy_s_total
        return _Sample(
            self._clock(), busy_s, s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens
        )

    def read(self) -> NodeReading:
        """The signals now (rates over the window since the previous read)."""
        now = self._sample()
        if now.t_s - self._last.t_s >= MIN_WINDOW_S:
            self._reading = self._read(self._last, now)
            self._last = now
        return self._reading

    def _read(self, old: _Sample, new: _Sample) -> NodeReading:
        faults = self._faults.faults
        dt_s = new.t_s - old.t_s
        util = min(1.0, (new.busy_s - old.busy_s) / dt_s) if dt_s > 0 else 0.0
        thermal_c, clock_ratio = self._faults.thermal_reading()
        span = LOAD_TEMPERATURE_C - IDLE_TEMPERATURE_C
        temperature_c = IDLE_TEMPERATURE_C + util * span if thermal_c is None else thermal_c
        hits = new.hits_tokens - old.hits_tokens
        fresh = new.queries_tokens - old.queries_tokens - hits
        rate = 1.0 / dt_s if dt_s > 0 else 0.0
        other = faults.pcie_saturation * PCIE_PEAK_BYTES_S
        tx = min(PCIE_PEAK_BYTES_S, fresh * self._kv_bytes_per_token * rate + other)
        rx_tokens = hits * self._kv_bytes_per_token + (fresh + hits) * TOKEN_ID_BYTES
        rx = min(PCIE_PEAK_BYTES_S, rx_tokens * rate + other)
        degrade_c = faults.nvlink_degrade_at_c
        is_degraded = degrade_c is not None and temperature_c >= degrade_c
        if self.tp > 1:
            width = 0.5 if is_degraded else 1.0
            link_bytes_s = self.gpu.link_bandwidth_gbs * 1e9 * NVLINK_BUSY_SHARE * width
            self._nvlink_kb += link_bytes_s * util * dt_s / 1e3
        if is_degraded:
            self._crc_errors += NVLINK_CRC_ERRORS_PER_S * dt_s
        max_clock = _MAX_SM_CLOCK_MHZ.get(self.gpu.name, DEFAULT_MAX_SM_CLOCK_MHZ)
        return NodeReading(
            temperature_c=round(temperature_c, 2),
            sm_clock_mhz=round(max_clock * clock_ratio),
            pcie_tx_bytes_s=tx,
            pcie_rx_bytes_s=rx,
            nvlink_total_kb=self._nvlink_kb,
            nvlink_crc_errors=float(int(self._crc_errors)),
            xid=faults.xid,
            ecc_dbe_errors=faults.ecc_dbe_errors,
        )

    def render(self) -> bytes:
        """The page in dcgm-exporter's form (``# HELP`` / ``# TYPE``, one series a GPU)."""
        r = self.read()
        series: list[tuple[str, str, str, float]] = [
            ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", r.sm_clock_mhz),
            ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", r.temperature_c),
            ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "gauge", "PCIe TX throughput (in KB/s).",
             round(r.pcie_tx_bytes_s / 1e3)),
            ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "gauge", "PCIe RX throughput (in KB/s).",
             round(r.pcie_rx_bytes_s / 1e3)),
            ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
             "The rate of data transmitted over the PCIe bus (in bytes/s).", r.pcie_tx_bytes_s),
            ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
             "The rate of data received over the PCIe bus (in bytes/s).", r.pcie_rx_bytes_s),
            ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
             float(r.xid)),
            ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
             "Total number of double-bit volatile ECC errors.", float(r.ecc_dbe_errors)),
            ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
             "Total number of NVLink bandwidth counters for all lanes (in KB).",
             round(r.nvlink_total_kb)),
            ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter",
             "Total number of NVLink flow-control CRC errors.", r.nvlink_crc_errors),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, doc, value in series:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{self._labels(i)}}} {_number(value)}" for i in range(self.tp)]
        return ("\n".join(lines) + "\n").encode()

    def _labels(self, index: int) -> str:
        model = f"NVIDIA {self.gpu.name}"
        return (
            f'gpu="{index}",UUID="{self.uuids[index]}",device="nvidia{index}",'
            f'modelName="{model}",Hostname="{self.hostname}"'
        )


def _number(value: float) -> str:
    """Integers without a fraction (dcgm-exporter's form), other values exactly."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
