"""routing/node_metrics.py: a dcgm-exporter page -> NodeMetrics and the verdict; the
table's use of it (``BackendTable.record_node``)."""

from __future__ import annotations

import pytest

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.routing.engine_metrics import EngineMetrics
from kiloserve.routing.node_metrics import (
    MAX_TEMPERATURE_C,
    NodeMetrics,
    node_problems,
    parse_node_metrics,
)
from kiloserve.routing.table import BackendTable

_L = 'UUID="GPU-1",device="nvidia{0}",modelName="NVIDIA H100 80GB HBM3",Hostname="n1"'
PAGE = "\n".join(
    [
        "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).",
        "# TYPE DCGM_FI_DEV_GPU_TEMP gauge",
        f'DCGM_FI_DEV_GPU_TEMP{{gpu="0",{_L.format(0)}}} 61',
        f'DCGM_FI_DEV_GPU_TEMP{{gpu="1",{_L.format(1)}}} 92',
        f'DCGM_FI_DEV_SM_CLOCK{{gpu="0",{_L.format(0)}}} 1980',
        f'DCGM_FI_DEV_SM_CLOCK{{gpu="1",{_L.format(1)}}} 990',
        f'DCGM_FI_DEV_PCIE_TX_THROUGHPUT{{gpu="0",{_L.format(0)}}} 16000000',
        f'DCGM_FI_DEV_PCIE_RX_THROUGHPUT{{gpu="1",{_L.format(1)}}} 8000000',
        f'DCGM_FI_DEV_XID_ERRORS{{gpu="0",{_L.format(0)}}} 0',
        f'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{gpu="0",{_L.format(0)}}} 0',
        f'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{gpu="1",{_L.format(1)}}} 0',
    ]
)


def test_worst_gpu_wins_and_kb_s_throughput_is_read() -> None:
    node = parse_node_metrics(PAGE)
    assert node.num_gpus == 2
    assert node.temperature_c == 92 and node.sm_clock_mhz == 990
    assert node.pcie_util == pytest.approx(16e9 / 32e9)  # KB/s x 1e3 / the Gen4 peak
    assert node_problems(node) == ["temperature 92 C"]
    assert node_problems(node, max_temperature_c=95.0) == []
    assert MAX_TEMPERATURE_C == 90.0


def test_prof_bytes_preferred_and_missing_series_are_none() -> None:
    page = 'DCGM_FI_PROF_PCIE_RX_BYTES{gpu="0"} 64e9\nDCGM_FI_DEV_PCIE_RX_THROUGHPUT{gpu="0"} 1'
    node = parse_node_metrics(page)
    assert node.pcie_util == 1.0  # clipped
    assert node.temperature_c is None and node.xid is None and node.ecc_dbe_errors is None
    assert parse_node_metrics("").num_gpus == 0


def test_table_takes_node_pcie_and_vetoes_a_sick_node() -> None:
    cfg = parse_gateway_config(
        {"backends": [{"url": "http://127.0.0.1:1", "name": "a", "models": ["m"]}]}
    )
    table = BackendTable(cfg)
    table.record_scrape("a", EngineMetrics("vllm", 0, 0, 0.1, None, 0, None), 1.0)
    assert table.state("a").pcie_util is None  # the engine page has no DCGM series
    table.record_node("a", NodeMetrics(num_gpus=1, pcie_util=0.8, xid=0), [])
    table.record_scrape("a", EngineMetrics("vllm", 0, 0, 0.1, None, 0, None), 2.0)
    assert table.state("a").pcie_util == 0.8 and table.is_routable("a")
    sick = NodeMetrics(num_gpus=1, pcie_util=0.8, xid=79)
    table.record_node("a", sick, node_problems(sick))
    row = table.describe(2.0)[0]
    assert not table.is_routable("a") and row["unhealthy_reasons"] == ["node"]
    assert row["node_problems"] == ["xid 79"] and row["node"]["xid"] == 79
    table.record_node("a", None)  # the node page is gone: no node signals, no veto
    assert table.is_routable("a") and table.describe(2.0)[0]["node"] is None
