"""Write the Grafana dashboards of deploy/grafana/ (S5.1 four layers + the gateway).

The JSON files are generated so that every panel has the same shape (datasource
variable, grid position, legend, unit) and stay reviewable as short Python lists of
``(title, unit, [(promql, legend), ...])``. Run ``python deploy/grafana/build_dashboards.py``
after editing; tests/unit/deploy/test_deploy_manifests.py fails when the committed JSON differs
from what this script writes, and cross-checks every metric name in the queries.

Import the files in Grafana (Dashboards > Import, or file provisioning) and pick the
Prometheus data source for the ``datasource`` variable.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Target = tuple[str, str]  # (PromQL, legend format)
Panel = tuple[str, str, list[Target]]  # (title, Grafana unit, targets)

HERE = Path(__file__).resolve().parent
GW = 'job=~"$gateway_job"'
ENG = 'job=~"$engine_job"'
Q = "histogram_quantile"


def _gateway_panels() -> list[Panel]:
    r = "[$__rate_interval]"
    return [
        ("Requests/s by status", "reqps",
         [(f"sum by (status) (rate(kiloserve_gateway_requests_total{{{GW}}}{r}))", "{{status}}")]),
        ("Share of requests by backend (S5.4 step 1: distribution)", "percentunit",
         [(f"sum by (backend) (rate(kiloserve_gateway_requests_total{{{GW},backend!=\"\"}}{r}))"
           f" / ignoring(backend) group_left sum(rate(kiloserve_gateway_requests_total"
           f"{{{GW},backend!=\"\"}}{r}))", "{{backend}}")]),
        ("Error rate (5xx share)", "percentunit",
         [(f"sum(rate(kiloserve_gateway_requests_total{{{GW},status=~\"5..\"}}{r}))"
           f" / sum(rate(kiloserve_gateway_requests_total{{{GW}}}{r}))", "5xx")]),
        ("TTFT P95 by backend", "s",
         [(f"{Q}(0.95, sum by (backend, le) (rate(kiloserve_gateway_ttft_seconds_bucket"
           f"{{{GW}}}{r})))", "{{backend}}")]),
        ("Inter-token gap P95 by backend", "s",
         [(f"{Q}(0.95, sum by (backend, le) (rate(kiloserve_gateway_inter_token_seconds_bucket"
           f"{{{GW}}}{r})))", "{{backend}}")]),
        ("End-to-end latency P95 by backend", "s",
         [(f"{Q}(0.95, sum by (backend, le) (rate(kiloserve_gateway_e2e_seconds_bucket"
           f"{{{GW}}}{r})))", "{{backend}}")]),
        ("In flight by backend", "short",
         [(f"sum by (backend) (kiloserve_gateway_in_flight{{{GW}}})", "{{backend}}")]),
        ("Routing decisions/s by policy and backend", "ops",
         [(f"sum by (policy, backend) (rate(kiloserve_gateway_routing_decisions_total"
           f"{{{GW}}}{r}))", "{{policy}} -> {{backend}}")]),
        ("Retries/s by failed backend and reason", "ops",
         [(f"sum by (backend, reason) (rate(kiloserve_gateway_retries_total{{{GW}}}{r}))",
           "{{backend}} {{reason}}")]),
        ("Backend health (1 healthy) and draining (1 drained)", "short",
         [(f"min by (backend) (kiloserve_gateway_backend_healthy{{{GW}}})", "healthy {{backend}}"),
          (f"max by (backend) (kiloserve_gateway_backend_draining{{{GW}}})",
           "draining {{backend}}")]),
        ("Effective routing weight", "short",
         [(f"avg by (backend) (kiloserve_gateway_backend_effective_weight{{{GW}}})",
           "{{backend}}")]),
        ("Engine metric age seen by the gateway", "s",
         [(f"max by (backend) (kiloserve_gateway_scrape_age_seconds{{{GW}}} < +Inf)",
           "{{backend}}"),
          (f"sum by (backend) (rate(kiloserve_gateway_scrape_errors_total{{{GW}}}{r}))",
           "scrape errors/s {{backend}}")]),
        ("Deployment records (S5.5): gateway and backend versions", "short",
         [(f"max by (instance, version, config_hash) (kiloserve_gateway_info{{{GW}}})",
           "gateway {{instance}} {{version}} config {{config_hash}}"),
          (f"max by (backend, model, version, gpu) (kiloserve_backend_info{{{GW}}})",
           "{{backend}} {{model}} {{version}} {{gpu}}")]),
    ]  # fmt: skip


def _hardware_panels() -> list[Panel]:
    return [
        ("GPU utilisation", "percent",
         [("DCGM_FI_DEV_GPU_UTIL", "{{Hostname}} gpu{{gpu}}")]),
        ("GPU temperature", "celsius",
         [("DCGM_FI_DEV_GPU_TEMP", "{{Hostname}} gpu{{gpu}}"),
          ("DCGM_FI_DEV_MEMORY_TEMP", "mem {{Hostname}} gpu{{gpu}}")]),
        ("GPU power", "watt",
         [("DCGM_FI_DEV_POWER_USAGE", "{{Hostname}} gpu{{gpu}}")]),
        ("GPU memory used", "decmbytes",
         [("DCGM_FI_DEV_FB_USED", "{{Hostname}} gpu{{gpu}}")]),
        ("ECC errors (volatile; double-bit = replace)", "short",
         [("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "single {{Hostname}} gpu{{gpu}}"),
          ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "double {{Hostname}} gpu{{gpu}}")]),
        ("PCIe link width (S5.2) vs maximum", "short",
         [("DCGM_FI_DEV_PCIE_LINK_WIDTH", "x {{Hostname}} gpu{{gpu}}"),
          ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "max {{Hostname}} gpu{{gpu}}")]),
        ("PCIe replays/s", "ops",
         [("rate(DCGM_FI_DEV_PCIE_REPLAY_COUNTER[$__rate_interval])",
           "{{Hostname}} gpu{{gpu}}")]),
        ("PCIe traffic", "Bps",
         [("rate(DCGM_FI_PROF_PCIE_RX_BYTES[$__rate_interval])", "rx {{Hostname}} gpu{{gpu}}"),
          ("rate(DCGM_FI_PROF_PCIE_TX_BYTES[$__rate_interval])", "tx {{Hostname}} gpu{{gpu}}")]),
        ("XID errors (last code)", "short",
         [("DCGM_FI_DEV_XID_ERRORS", "{{Hostname}} gpu{{gpu}}")]),
    ]  # fmt: skip


def _runtime_panels() -> list[Panel]:
    r = "[$__rate_interval]"
    return [
        ("Per-core CPU busy (S5.2)", "percentunit",
         [(f'1 - rate(node_cpu_seconds_total{{mode="idle"}}{r})', "{{instance}} cpu{{cpu}}")]),
        ("IO wait (S5.2)", "percentunit",
         [(f'avg by (instance) (rate(node_cpu_seconds_total{{mode="iowait"}}{r}))',
           "{{instance}}")]),
        ("Available memory (S5.2)", "bytes",
         [("node_memory_MemAvailable_bytes", "{{instance}}")]),
        ("Network receive errors/s (S5.2)", "ops",
         [(f'rate(node_network_receive_errs_total{{device!~"lo|veth.*"}}{r})',
           "{{instance}} {{device}}")]),
        ("Network traffic", "Bps",
         [(f'rate(node_network_receive_bytes_total{{device!~"lo|veth.*"}}{r})',
           "rx {{instance}} {{device}}"),
          (f'rate(node_network_transmit_bytes_total{{device!~"lo|veth.*"}}{r})',
           "tx {{instance}} {{device}}")]),
        ("Load average (1 min)", "short", [("node_load1", "{{instance}}")]),
        ("Container CPU (engine and gateway pods)", "short",
         [(f'sum by (pod) (rate(container_cpu_usage_seconds_total{{container!=""}}{r}))',
           "{{pod}}")]),
        ("Container memory (working set)", "bytes",
         [('sum by (pod) (container_memory_working_set_bytes{container!=""})', "{{pod}}")]),
    ]  # fmt: skip


def _engine_panels() -> list[Panel]:
    r = "[$__rate_interval]"
    return [
        ("Running requests (batch)", "short",
         [(f"sum by (instance) (vllm:num_requests_running{{{ENG}}})", "{{instance}}")]),
        ("Waiting requests (queue)", "short",
         [(f"sum by (instance) (vllm:num_requests_waiting{{{ENG}}})", "{{instance}}")]),
        ("KV cache usage (alarm > 0.92)", "percentunit",
         [(f"max by (instance) (vllm:kv_cache_usage_perc{{{ENG}}})", "{{instance}}")]),
        ("Prefix cache hit rate", "percentunit",
         [(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{ENG}}}{r}))"
           f" / sum by (instance) (rate(vllm:prefix_cache_queries_total{{{ENG}}}{r}))",
           "{{instance}}")]),
        ("Preemptions/s", "ops",
         [(f"sum by (instance) (rate(vllm:num_preemptions_total{{{ENG}}}{r}))",
           "{{instance}}")]),
        ("Tokens/s (prefill and generation)", "short",
         [(f"sum by (instance) (rate(vllm:prompt_tokens_total{{{ENG}}}{r}))",
           "prefill {{instance}}"),
          (f"sum by (instance) (rate(vllm:generation_tokens_total{{{ENG}}}{r}))",
           "decode {{instance}}")]),
        ("Engine TTFT P95", "s",
         [(f"{Q}(0.95, sum by (instance, le) (rate(vllm:time_to_first_token_seconds_bucket"
           f"{{{ENG}}}{r})))", "{{instance}}")]),
        ("Engine inter-token latency P95", "s",
         [(f"{Q}(0.95, sum by (instance, le) (rate(vllm:inter_token_latency_seconds_bucket"
           f"{{{ENG}}}{r})))", "{{instance}}")]),
        ("Finished requests/s by reason", "ops",
         [(f"sum by (finished_reason) (rate(vllm:request_success_total{{{ENG}}}{r}))",
           "{{finished_reason}}")]),
        ("Engine twin loop lag (twins only)", "s",
         [(f"max by (instance) (kiloserve_twin_loop_lag_seconds{{{ENG}}})", "{{instance}}")]),
    ]  # fmt: skip


def _business_panels() -> list[Panel]:
    r = "[$__rate_interval]"
    ttft = f"sum by (le) (rate(kiloserve_gateway_ttft_seconds_bucket{{{GW}}}{r}))"
    itl = f"sum by (le) (rate(kiloserve_gateway_inter_token_seconds_bucket{{{GW}}}{r}))"
    return [
        ("TTFT SLO compliance: share within 1 s (alarm < 95%)", "percentunit",
         [(f'sum(rate(kiloserve_gateway_ttft_seconds_bucket{{{GW},le="1.0"}}{r}))'
           f" / sum(rate(kiloserve_gateway_ttft_seconds_count{{{GW}}}{r}))", "within 1 s")]),
        ("TTFT P50 / P95 / P99", "s",
         [(f"{Q}(0.5, {ttft})", "P50"), (f"{Q}(0.95, {ttft})", "P95"),
          (f"{Q}(0.99, {ttft})", "P99")]),
        ("TPOT (inter-token gap) P50 / P95", "s",
         [(f"{Q}(0.5, {itl})", "P50"), (f"{Q}(0.95, {itl})", "P95")]),
        ("Requests/s by model", "reqps",
         [(f'sum by (model) (rate(kiloserve_gateway_requests_total{{{GW},model!=""}}{r}))',
           "{{model}}")]),
        ("Error codes/s", "reqps",
         [(f'sum by (status) (rate(kiloserve_gateway_requests_total{{{GW},status!~"2.."}}{r}))',
           "{{status}}")]),
        ("Per-node TTFT P95 (S5.3: one slow node explains the skew)", "s",
         [(f"{Q}(0.95, sum by (backend, le) (rate(kiloserve_gateway_ttft_seconds_bucket"
           f"{{{GW}}}{r})))", "{{backend}}")]),
        ("Generated tokens/s (all engines)", "short",
         [(f"sum(rate(vllm:generation_tokens_total{{{ENG}}}{r}))", "tokens/s")]),
    ]  # fmt: skip


DASHBOARDS: dict[str, tuple[str, Callable[[], list[Panel]]]] = {
    "kiloserve-gateway": ("kiloserve: gateway (routing, backends, deployment)", _gateway_panels),
    "kiloserve-hardware": ("kiloserve layer 1: hardware (DCGM)", _hardware_panels),
    "kiloserve-runtime": ("kiloserve layer 2: runtime (CPU, memory, net, disk)", _runtime_panels),
    "kiloserve-engine": ("kiloserve layer 3: engine (vLLM metrics)", _engine_panels),
    "kiloserve-business": ("kiloserve layer 4: business (TTFT, TPOT, errors)", _business_panels),
}  # fmt: skip


def _variable(name: str, label: str, query: str, default: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": default, "value": default},
        "refresh": 2,
    }


def _templating() -> dict[str, Any]:
    source = {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
    }
    gw = _variable("gateway_job", "Gateway job", "label_values(kiloserve_gateway_in_flight, job)",
                   "kiloserve-gateway")  # fmt: skip
    eng = _variable("engine_job", "Engine job", "label_values(vllm:num_requests_running, job)",
                    "vllm-engine")  # fmt: skip
    return {"list": [source, gw, eng]}


def _panel(panel_id: int, panel: Panel) -> dict[str, Any]:
    title, unit, targets = panel
    col, row = (panel_id - 1) % 2, (panel_id - 1) // 2
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * col, "y": 8 * row},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def build(uid: str) -> dict[str, Any]:
    """The dashboard model of ``uid`` (a key of ``DASHBOARDS``)."""
    title, panels_of = DASHBOARDS[uid]
    panels = [_panel(i, p) for i, p in enumerate(panels_of(), start=1)]
    return {
        "uid": uid,
        "title": title,
        "tags": ["kiloserve"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": _templating(),
        "annotations": {"list": []},
        "links": [{"title": "kiloserve", "type": "dashboards", "tags": ["kiloserve"]}],
        "panels": panels,
    }


def render(uid: str) -> str:
    return json.dumps(build(uid), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else HERE
    for uid in DASHBOARDS:
        (out_dir / f"{uid}.json").write_text(render(uid), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
