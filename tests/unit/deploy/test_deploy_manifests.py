"""Offline checks of deploy/ and the Dockerfile (issue 9 parts 2-4; no cluster needed).

- Prometheus: ``promtool check config`` / ``check rules`` / ``test rules`` (Debian's
  ``prometheus`` package, installed by scripts/ensure_tools.sh).
- Kubernetes: every object validated against the packaged OpenAPI schemas of
  ``kubernetes-validate`` (strict: unknown fields fail), plus the invariants S7.2 asks for.
- Grafana: the committed JSON equals what deploy/grafana/build_dashboards.py writes, and
  has the structure Grafana imports.
- Every metric name in a dashboard or alert is one the code exports (rendered here from
  the gateway's and the twin's real collectors) or a well-known dcgm-exporter /
  node-exporter / cAdvisor name.
- HAProxy: ``haproxy -c``; Dockerfile: parsed with dockerfile-parse and checked.
- Deployment records (S5.5): the config hash and the ``*_info`` series.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO
from kiloserve import __version__
from kiloserve.engine.metrics import EngineStats, TwinMetrics
from kiloserve.gateway.admin import config_hash
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.routing.table import BackendTable

DEPLOY = REPO / "deploy"
PROM = DEPLOY / "prometheus"
K8S = DEPLOY / "k8s"
GRAFANA = DEPLOY / "grafana"
TOOLS_HINT = "run scripts/ensure_tools.sh (Debian packages prometheus, haproxy)"

# Well-known names of exporters we do not run in tests, from their documentation:
# NVIDIA dcgm-exporter (DCGM field names), prometheus node-exporter, cAdvisor (kubelet),
# and Prometheus' own per-target series.
EXTERNAL_METRICS = frozenset({
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_PCIE_LINK_WIDTH", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_DEV_XID_ERRORS",
    "node_cpu_seconds_total", "node_memory_MemAvailable_bytes", "node_memory_MemTotal_bytes",
    "node_network_receive_errs_total", "node_network_receive_bytes_total",
    "node_network_transmit_bytes_total", "node_load1",
    "container_cpu_usage_seconds_total", "container_memory_working_set_bytes",
    "up",
})  # fmt: skip
PROMQL_WORDS = frozenset({
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "time", "timestamp", "label_values", "Inf", "NaN", "e",
})  # fmt: skip


def _sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def exported_metric_names() -> set[str]:
    """Every sample name the gateway and the engine twin really export."""
    cfg = parse_gateway_config({"backends": [{"url": "http://127.0.0.1:9", "name": "b"}]})
    gw = GatewayMetrics(BackendTable(cfg))
    gw.request_done("m", "b", 200)
    gw.retry("b", "connect")
    gw.decision("default", "b")
    for observe in (gw.observe_ttft, gw.observe_itl, gw.observe_e2e):
        observe("b", 0.1)
    twin = TwinMetrics("m", lambda: EngineStats(1, 2, 0.5, 10, 5, 0))
    twin.on_first_token(0.1, 10)
    twin.on_tokens(1, 0.01)
    twin.on_finished("stop", 1.0)
    return _sample_names(gw.render().decode()) | _sample_names(twin.render().decode())


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, ranges, groupings removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        if m.group(2) is None and m.group(1) not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def test_promql_metric_names_parser() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (backend, le) (rate(kiloserve_gateway_ttft_seconds_bucket"
        '{job=~"$gateway_job", le="1.0"}[$__rate_interval]))) / ignoring(backend) group_left '
        "sum(vllm:kv_cache_usage_perc) > 0.92 and on (job) up == 1 < +Inf"
    )
    assert promql_metric_names(expr) == {
        "kiloserve_gateway_ttft_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "up",
    }


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(f"promtool not installed: {TOOLS_HINT}")
    return path


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_check_rules_and_rule_unit_tests() -> None:
    promtool = _promtool()
    checked = _run([promtool, "check", "rules", "alerts.yml"], cwd=PROM)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 16 rules found" in checked.stdout
    tested = _run([promtool, "test", "rules", "alerts_test.yml"], cwd=PROM)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    promtool = _promtool()
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n- name: x\n  rules:\n  - alert: A\n    expr: sum(rate(x[5m])\n")
    assert _run([promtool, "check", "rules", str(bad)]).returncode != 0


def test_promtool_check_config(tmp_path: Path) -> None:
    promtool = _promtool()
    plain = _run([promtool, "check", "config", "prometheus.yml"], cwd=PROM)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    # Debian's promtool lacks Kubernetes discovery: check the k8s file without it.
    k8s = yaml.safe_load((PROM / "prometheus-k8s.yml").read_text())
    for job in k8s["scrape_configs"]:
        assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] in (["pod"], ["node"])
    shutil.copy(PROM / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "k8s.yml").write_text(yaml.safe_dump(k8s))
    stripped = _run([promtool, "check", "config", "k8s.yml"], cwd=tmp_path)
    assert stripped.returncode == 0, stripped.stdout + stripped.stderr


def test_both_prometheus_configs_have_the_same_jobs_and_rules() -> None:
    plain = yaml.safe_load((PROM / "prometheus.yml").read_text())
    k8s = yaml.safe_load((PROM / "prometheus-k8s.yml").read_text())
    jobs = ["kiloserve-gateway", "vllm-engine", "dcgm-exporter", "node-exporter"]
    assert [j["job_name"] for j in plain["scrape_configs"]] == jobs
    assert [j["job_name"] for j in k8s["scrape_configs"]] == jobs
    assert plain["rule_files"] == k8s["rule_files"] == ["alerts.yml"]
    assert plain["global"] == k8s["global"]


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [rule for g in groups for rule in g["rules"]]


def test_alerts_cover_the_golden_signals() -> None:
    by_name = {r["alert"]: r for r in _alert_rules()}
    for name in (
        "KVCacheUsageHigh", "TTFTSLOComplianceLow", "BackendUnhealthy", "BackendEjected",
        "EngineMetricsStale", "ScrapeTargetDown", "QueueRejections", "HighErrorRate",
        "GPUPCIeLinkDegraded", "NetworkReceiveErrors", "CPUCoreSaturated",
        "AvailableMemoryLow", "DiskIOWaitHigh",
    ):  # fmt: skip
        assert name in by_name, name
    assert "> 0.92" in by_name["KVCacheUsageHigh"]["expr"]
    assert "< 0.95" in by_name["TTFTSLOComplianceLow"]["expr"]
    assert all({"summary", "description"} <= set(r["annotations"]) for r in by_name.values())
    assert all(r["labels"]["severity"] in {"warning", "critical"} for r in by_name.values())


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(GRAFANA.glob("*.json"))}


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for d in _dashboards().values() for p in d["panels"] for t in p["targets"]]


def test_every_metric_name_in_dashboards_and_alerts_exists() -> None:
    known = exported_metric_names() | EXTERNAL_METRICS
    used: dict[str, set[str]] = {}
    for expr in [*_dashboard_exprs(), *(r["expr"] for r in _alert_rules())]:
        for name in promql_metric_names(expr):
            used.setdefault(name, set()).add(expr)
    unknown = {n: sorted(e)[0] for n, e in used.items() if n not in known}
    assert not unknown, f"metric names nobody exports: {unknown}"
    assert {"kiloserve_gateway_ttft_seconds_bucket", "vllm:kv_cache_usage_perc"} <= set(used)


def _load_builder() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_dashboards", GRAFANA / "build_dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_dashboards"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["build_dashboards"]
    return module


def test_committed_dashboards_match_the_generator() -> None:
    builder = _load_builder()
    expected = {"kiloserve-gateway", "kiloserve-hardware", "kiloserve-runtime",
                "kiloserve-engine", "kiloserve-business"}  # fmt: skip
    assert set(builder.DASHBOARDS) == expected == set(_dashboards())
    for uid in expected:
        committed = (GRAFANA / f"{uid}.json").read_text()
        assert committed == builder.render(uid), f"re-run build_dashboards.py for {uid}"


def test_dashboards_have_the_structure_grafana_imports() -> None:
    for uid, dash in _dashboards().items():
        assert dash["uid"] == uid and dash["title"] and dash["schemaVersion"] >= 30
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        panels = dash["panels"]
        assert len(panels) >= 6, uid
        assert len({p["id"] for p in panels}) == len(panels)
        cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
        assert len(cells) == len(panels), f"{uid}: overlapping panels"
        for panel in panels:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(set(refs)) == len(refs)
            assert all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"])
            for target in panel["targets"]:
                used = re.findall(r"\$(\w+)", target["expr"])
                assert set(used) <= {*variables, "__rate_interval"}, (uid, target["expr"])


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _kv() -> Any:
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')"
    )


def test_k8s_manifests_validate_against_the_packaged_schema() -> None:
    kv = _kv()
    docs = _k8s_docs()
    assert len(docs) >= 12
    for name, doc in docs:
        try:
            kv.validate(doc, "1.30.0", strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


def test_k8s_validator_rejects_a_typo() -> None:
    kv = _kv()
    deployment = next(d for _, d in _k8s_docs() if d["kind"] == "Deployment")
    deployment = json.loads(json.dumps(deployment))
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, "1.30.0", strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def test_gateway_deployment_probes_config_and_budget() -> None:
    objs = _objects()
    dep = objs[("Deployment", "kiloserve-gateway")]
    (container,) = _pod_spec(dep)["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    cfg_map = objs[("ConfigMap", "kiloserve-gateway")]
    cfg = parse_gateway_config(yaml.safe_load(cfg_map["data"]["gateway.yaml"]))
    assert cfg.backends and cfg.port == container["ports"][0]["containerPort"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for kind in ("PodDisruptionBudget", "Service"):
        obj = objs[(kind, "kiloserve-gateway")]
        selector = obj["spec"].get("selector", {})
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= pod_labels.items(), kind
    hpa = objs[("HorizontalPodAutoscaler", "kiloserve-gateway")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kiloserve-gateway"
    pods_metric = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    adapter = objs[("ConfigMap", "kiloserve-prometheus-adapter")]["data"]["config.yaml"]
    assert pods_metric["pods"]["metric"]["name"] in adapter


def test_gateway_deployment_sizes_its_workers_by_the_cpu_request() -> None:
    """One worker per requested core, through the downward API (without ``--workers``
    the gateway would start one per CPU of the node: no CPU limit is set), and a memory
    limit that holds them (~60-70 MiB a process, the supervisor included)."""
    dep = _objects()[("Deployment", "kiloserve-gateway")]
    (container,) = _pod_spec(dep)["containers"]
    args = container["args"]
    value = args[args.index("--workers") + 1]
    assert value.startswith("$(") and value.endswith(")"), args
    env = {e["name"]: e for e in container["env"]}
    field = env[value[2:-1]]["valueFrom"]["resourceFieldRef"]
    assert field["containerName"] == container["name"]
    assert field["resource"] == "requests.cpu" and str(field["divisor"]) == "1"
    resources = container["resources"]
    cpus = math.ceil(float(resources["requests"]["cpu"]))
    assert cpus >= 2  # the point of the workers
    limit_mib = int(resources["limits"]["memory"].removesuffix("Gi")) * 1024
    assert limit_mib >= (cpus + 1) * 128


def test_engine_deployment_gpu_spread_and_agent() -> None:
    objs = _objects()
    dep = objs[("Deployment", "vllm-llama-8b")]
    pod = _pod_spec(dep)
    by_name = {c["name"]: c for c in pod["containers"]}
    gpu = by_name["vllm"]["resources"]
    assert gpu["requests"]["nvidia.com/gpu"] == gpu["limits"]["nvidia.com/gpu"] == "1"
    assert by_name["kiloserve-agent"]["args"][0] == "agent"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert {"topology.kubernetes.io/zone", "kubernetes.io/hostname"} <= keys
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "engine"  # what Prometheus selects
    assert objs[("HorizontalPodAutoscaler", "vllm-llama-8b")]["spec"]["metrics"][0]["type"] == (
        "External"
    )
    assert ("StatefulSet", "kiloserve-etcd") in objs


def test_haproxy_config_is_valid() -> None:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(haproxy).exists():
        pytest.skip(f"haproxy not installed: {TOOLS_HINT}")
    checked = _run([haproxy, "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    text = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    assert "option redispatch" in text and "retries 3" in text and "uri /ready" in text


def test_dockerfile_parses_and_runs_the_gateway_as_non_root() -> None:
    dfp = pytest.importorskip("dockerfile_parse", reason="dockerfile-parse not installed")
    parser = dfp.DockerfileParser(path=str(REPO / "Dockerfile"))
    steps = [
        (s["instruction"], s["value"]) for s in parser.structure if s["instruction"] != "COMMENT"
    ]
    instructions = [i for i, _ in steps]
    assert instructions.count("FROM") == 2
    final = steps[max(i for i, (ins, _) in enumerate(steps) if ins == "FROM") :]
    values = {ins: val for ins, val in final}
    assert values["USER"].split(":")[0] not in {"0", "root"}
    assert values["EXPOSE"] == "8000"
    assert "/health" in values["HEALTHCHECK"]
    assert json.loads(values["ENTRYPOINT"]) == ["kiloserve"]
    assert json.loads(values["CMD"])[0] == "gateway"
    for ins, val in steps:  # every build-context path copied exists
        if ins == "COPY" and not val.startswith("--from"):
            for src in val.split()[:-1]:
                assert (REPO / src).exists(), src


def test_config_hash_tracks_the_config_but_not_the_secret() -> None:
    base = {"backends": [{"url": "http://127.0.0.1:9", "name": "b"}]}
    same = config_hash(parse_gateway_config(base))
    assert same == config_hash(parse_gateway_config(base))
    assert re.fullmatch(r"[0-9a-f]{16}", same)
    assert config_hash(parse_gateway_config({**base, "retries": 5})) != same
    with_token = [config_hash(parse_gateway_config({**base, "admin_token": t})) for t in "xy"]
    assert with_token[0] == with_token[1] != same  # a token is set, its value is not hashed


def test_backend_info_has_one_series_per_backend_and_model() -> None:
    cfg = parse_gateway_config({"backends": [
        {"url": "http://127.0.0.1:9", "name": "b", "models": ["m1", "m2"], "gpu": "H100",
         "version": "v2"},
        {"url": "http://127.0.0.1:10", "name": "c"},
    ]})  # fmt: skip
    text = GatewayMetrics(BackendTable(cfg), config_hash="abc").render().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("_info")
    }
    info = (("config_hash", "abc"), ("version", __version__))
    none = (("engine", ""), ("engine_version", ""))  # not collected yet (gateway/inventory.py)
    assert samples == {
        ("kiloserve_gateway_info", info, 1.0),
        ("kiloserve_backend_info", (("backend", "b"), *none, ("gpu", "H100"),
                                    ("max_model_len", ""), ("model", "m1"), ("model_root", ""),
                                    ("version", "v2")), 1.0),
        ("kiloserve_backend_info", (("backend", "b"), *none, ("gpu", "H100"),
                                    ("max_model_len", ""), ("model", "m2"), ("model_root", ""),
                                    ("version", "v2")), 1.0),
        ("kiloserve_backend_info", (("backend", "c"), *none, ("gpu", ""),
                                    ("max_model_len", ""), ("model", ""), ("model_root", ""),
                                    ("version", "")), 1.0),
    }  # fmt: skip
