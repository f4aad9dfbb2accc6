"""llama.cpp's ``llama-server`` as a second engine type in the gateway's pool.

The pool is vllm-a (when vLLM is installed) plus one llama-server; the gateway config
comes from ``kiloserve up``'s own writer, so each backend carries its metric dialect.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from conftest import (
    SERVED_MODEL,
    RealEnv,
    admin_backends,
    http_json,
    http_text,
    metric_sum,
    wait_for,
)
from kiloserve.launch.cluster import BackendInfo, LocalCluster, free_port, gateway_config
from kiloserve.launch.process import ChildProcess

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

LLAMACPP_METRICS = (
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:tokens_predicted_total",
    "llamacpp:prompt_tokens_total",
)


@pytest.fixture(scope="module")
def pool(
    request: pytest.FixtureRequest,
    real_env: RealEnv,
    llamacpp_cluster: LocalCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, list[BackendInfo]]]:
    """A round-robin gateway over [vllm-a,] llama; yields (gateway URL, backends)."""
    backends = list(llamacpp_cluster.backends)
    if not real_env.vllm_skip:
        vllm: LocalCluster = request.getfixturevalue("vllm_cluster")
        backends = [vllm.backends[0], *backends]
    port = free_port()
    conf = gateway_config(llamacpp_cluster.cfg, backends, port)
    conf |= {"policy": {"name": "round_robin", "params": {}}, "scrape_interval_s": 0.1}
    run_dir = tmp_path_factory.mktemp("mixed-gateway")
    path = Path(run_dir) / "gateway.yaml"
    path.write_text(yaml.safe_dump(conf, sort_keys=False))
    child = ChildProcess(
        name="gateway",
        argv=[sys.executable, "-m", "kiloserve", "gateway", "-c", str(path)],
        url=f"http://127.0.0.1:{port}",
        log_path=run_dir / "gateway.log",
        health_path="/ready",
    )
    child.start()
    try:
        child.wait_healthy(60)
        yield child.url, backends
    finally:
        child.stop()


def test_health_and_metric_names(llamacpp_cluster: LocalCluster) -> None:
    url = llamacpp_cluster.backends[0].url
    assert http_json(url + "/health")["status"] == "ok"
    page = http_text(url + "/metrics")
    missing = [name for name in LLAMACPP_METRICS if name not in page]
    assert missing == []


def test_gateway_scrapes_llamacpp_dialect(pool: tuple[str, list[BackendInfo]]) -> None:
    gw, _ = pool
    config = http_json(gw + "/admin/config")
    dialects = {b["name"]: b["engine"] for b in config["backends"]}
    assert dialects["llama"] == "llamacpp"
    if "vllm-a" in dialects:
        assert dialects["vllm-a"] == "vllm"
    wait_for(lambda: admin_backends(gw)["llama"]["num_running"] is not None, 10, "a scrape")
    row = admin_backends(gw)["llama"]
    assert row["engine"] == "llamacpp"
    assert (row["num_running"], row["num_waiting"]) == (0, 0)
    assert row["healthy"] and not row["scrape_stale"]


def test_requests_through_the_mixed_pool(
    pool: tuple[str, list[BackendInfo]], llamacpp_cluster: LocalCluster
) -> None:
    gw, backends = pool
    llama_url = llamacpp_cluster.backends[0].url

    def predicted() -> float:
        return metric_sum(http_text(llama_url + "/metrics"), "llamacpp:tokens_predicted_total")

    before = predicted()
    served: dict[str, int] = {}
    with openai.OpenAI(base_url=gw + "/v1", api_key="none") as client:
        for i in range(2 * len(backends)):
            raw = client.completions.with_raw_response.create(
                model=SERVED_MODEL,
                prompt=f"Return the lowest index in the string {i}",
                max_tokens=10,
                extra_body={"ignore_eos": True},
            )
            done = raw.parse()
            backend = raw.headers["x-kiloserve-backend"]
            assert done.usage is not None and done.usage.completion_tokens == 10, backend
            served[backend] = served.get(backend, 0) + 1
        stream = client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
    assert served == {b.name: 2 for b in backends}
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    # llama.cpp counts exactly what it returned through the gateway: 2 requests x 10
    # tokens, plus the 6-token chat stream if round robin sent that one to it too.
    wait_for(lambda: predicted() - before >= 20, 5, "llama.cpp's token counter")
    assert predicted() - before in (20, 26)


def test_kiloserve_up_starts_llamacpp_from_yaml(real_env: RealEnv, tmp_path: Path) -> None:
    """The `kiloserve up` command itself, with a real engine from the cluster YAML."""
    line = {
        "name": "llama-up",
        "engine": "llama.cpp",
        "model": SERVED_MODEL,
        "model_path": real_env.gguf,
        "command": real_env.llama_server,
        "extra_args": ["-t", "1", "-c", "1024"],
    }
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump({"gateway": {"port": 0}, "backends": [line]}))
    argv = [sys.executable, "-m", "kiloserve", "up", "-c", str(cfg)]
    argv += ["--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = _read_until(proc, "Ctrl-C", 60)
        match = re.search(r"gateway: (http://127\.0\.0\.1:\d+)", seen)
        assert match, seen
        gw = match.group(1)
        assert [m["id"] for m in http_json(gw + "/v1/models")["data"]] == [SERVED_MODEL]
        done = http_json(
            gw + "/v1/completions",
            {"model": SERVED_MODEL, "prompt": "up", "max_tokens": 3, "ignore_eos": True},
        )
        assert done["usage"]["completion_tokens"] == 3
        conf = yaml.safe_load((tmp_path / "run" / "gateway.yaml").read_text())
        assert conf["backends"][0]["engine"] == "llamacpp"
        children = _children(proc.pid)
        assert children
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert [c for c in children if Path(f"/proc/{c}").exists() and _alive(c)] == []


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + timeout_s
    while marker not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    return seen


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(c) for c in out.split()]


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except OSError:
        return False
