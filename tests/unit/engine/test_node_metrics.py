"""The twin's node page (engine/node_metrics.py): dcgm-exporter names and labels,
values from the modelled load, and the node faults that move them."""

from __future__ import annotations

import pytest

from kiloserve.catalog import get_gpu
from kiloserve.engine.faults import FaultInjector, FaultSet, ThermalFault
from kiloserve.engine.metrics import EngineStats
from kiloserve.engine.node_metrics import (
    IDLE_TEMPERATURE_C,
    LOAD_TEMPERATURE_C,
    PCIE_PEAK_BYTES_S,
    NodeModel,
)
from kiloserve.errors import RequestError
from kiloserve.routing import engine_metrics
from kiloserve.routing.engine_metrics import parse_samples
from kiloserve.routing.node_metrics import node_problems, parse_node_metrics

KV_BYTES_PER_TOKEN = 131_072


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Stats:
    def __init__(self) -> None:
        self.queries_tokens = 0
        self.hits_tokens = 0

    def __call__(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, self.queries_tokens, self.hits_tokens, 0)


def _node(tp: int = 1, faults: FaultSet | None = None) -> tuple[NodeModel, Clock, Stats]:
    clock, stats = Clock(), Stats()
    injector = FaultInjector(faults, clock=clock)
    node = NodeModel(get_gpu("H100"), tp, KV_BYTES_PER_TOKEN, stats, injector, clock)
    return node, clock, stats


def test_page_uses_dcgm_names_labels_and_one_series_per_gpu() -> None:
    node, _, _ = _node(tp=2)
    samples = parse_samples(node.render().decode())
    names = {name for name, _, _ in samples}
    assert {
        "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    } <= names  # fmt: skip
    temps = [labels for name, labels, _ in samples if name == "DCGM_FI_DEV_GPU_TEMP"]
    assert [t["gpu"] for t in temps] == ["0", "1"]
    assert {"UUID", "modelName", "Hostname", "device"} <= temps[0].keys()
    assert temps[0]["UUID"].startswith("GPU-") and temps[0]["UUID"] != temps[1]["UUID"]
    assert "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter" in node.render().decode()


def test_pcie_follows_prefill_and_prefix_hits() -> None:
    node, clock, stats = _node()
    clock.now_s, stats.queries_tokens, stats.hits_tokens = 1.0, 1000, 400
    r = node.read()
    assert r.pcie_tx_bytes_s == pytest.approx(600 * KV_BYTES_PER_TOKEN)  # new KV out
    assert r.pcie_rx_bytes_s == pytest.approx(400 * KV_BYTES_PER_TOKEN + 1000 * 4)
    text = node.render().decode()
    kb_s = [v for n, _, v in parse_samples(text) if n == "DCGM_FI_DEV_PCIE_TX_THROUGHPUT"]
    assert kb_s == [pytest.approx(r.pcie_tx_bytes_s / 1e3, abs=1)]  # KB/s, as DCGM


def test_pcie_saturation_fault_fills_the_link_and_the_gateway_reads_it() -> None:
    node, clock, _ = _node(faults=FaultSet(pcie_saturation=0.9))
    clock.now_s = 1.0
    parsed = parse_node_metrics(node.render().decode())
    assert parsed.pcie_util == pytest.approx(0.9)
    assert PCIE_PEAK_BYTES_S == engine_metrics.PCIE_PEAK_BYTES_S  # one divisor


def test_temperature_from_load_and_clock_drops_when_throttled() -> None:
    node, clock, _ = _node()
    node._faults.on_step(0.0, 0.5)  # busy half of the first second
    clock.now_s = 1.0
    r = node.read()
    assert r.temperature_c == pytest.approx((IDLE_TEMPERATURE_C + LOAD_TEMPERATURE_C) / 2)
    assert r.sm_clock_mhz == 1980
    hot = ThermalFault(throttle_at_c=60.0, factor=2.0, time_constant_s=0.1)
    node._faults.replace(FaultSet(thermal=hot))
    node._faults.on_step(1.0, 3.0)
    clock.now_s = 3.0
    r = node.read()
    assert r.temperature_c > 85.0 and r.sm_clock_mhz == 990


def test_nvlink_halves_when_hot_and_counts_crc_errors() -> None:
    hot = ThermalFault(throttle_at_c=95.0, factor=1.0, load_c=90.0, time_constant_s=0.01)
    node, clock, _ = _node(tp=2, faults=FaultSet(thermal=hot, nvlink_degrade_at_c=200.0))
    node._faults.on_step(0.0, 1.0)
    clock.now_s = 1.0
    full_kb = node.read().nvlink_total_kb
    assert full_kb > 0 and node.read().nvlink_crc_errors == 0
    node._faults.replace(FaultSet(thermal=hot, nvlink_degrade_at_c=75.0))
    node._faults.on_step(1.0, 2.0)
    clock.now_s = 2.0
    r = node.read()
    assert r.nvlink_total_kb - full_kb == pytest.approx(full_kb / 2)
    assert r.nvlink_crc_errors > 0
    assert parse_node_metrics(node.render().decode()).nvlink_crc_errors == 2 * 5  # 2 GPUs


def test_xid_and_ecc_faults_make_the_node_unhealthy() -> None:
    node, clock, _ = _node(faults=FaultSet(xid=79, ecc_dbe_errors=2))
    clock.now_s = 1.0
    parsed = parse_node_metrics(node.render().decode())
    assert (parsed.xid, parsed.ecc_dbe_errors) == (79, 2)
    assert node_problems(parsed) == ["xid 79", "2 uncorrectable ECC errors"]
    node._faults.replace(FaultSet())
    clock.now_s = 2.0
    assert node_problems(parse_node_metrics(node.render().decode())) == []


def test_node_fault_json_round_trip_and_validation() -> None:
    body = {"pcie_saturation": 0.5, "nvlink_degrade_at_c": 75.0, "xid": 48, "ecc_dbe_errors": 1}
    assert FaultSet.from_json(body).to_json() == body
    for bad in ({"pcie_saturation": 1.5}, {"xid": -1}, {"ecc_dbe_errors": -2}, {"xid": 1.5}):
        with pytest.raises(RequestError):
            FaultSet.from_json(bad)
