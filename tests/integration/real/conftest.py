"""Fixtures for the real-engine tests: two vLLM (CPU) instances behind the gateway, llama.cpp.

``scripts/real_engines.sh`` (``make real-engines``) installs vLLM and builds llama-server
into ``$KILOSERVE_CACHE`` (default ``~/.cache/kiloserve``) and writes ``real-engines.env``;
these fixtures read it. When something could not be installed the tests skip, all with
the one reason the script recorded (``pytest -ra`` folds it into a single line).

Engines start once per session through ``LocalCluster`` (the code ``kiloserve up``
runs), bound to 127.0.0.1, with per-instance TMPDIR/cache folders, and are stopped
(process group, SIGTERM then SIGKILL) at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config

REPO = Path(__file__).resolve().parents[3]


def _reexport_root_conftest() -> None:
    """Keep ``from conftest import free_port`` working in every other test module.

    pytest imports each conftest.py as the module ``conftest`` and the last one loaded
    wins ``sys.modules["conftest"]``; this folder sorts before ``test_*.py``, so other
    modules' ``from conftest import ...`` would find this file. It re-exports the public
    names of tests/conftest.py (its fixtures then resolve to the very same functions).
    """
    root_conftest = REPO / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_kiloserve_tests_conftest", root_conftest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in dir(module):
        if not name.startswith("_") and name not in globals():
            globals()[name] = getattr(module, name)


_reexport_root_conftest()
SERVED_MODEL = "tiny"
MAX_NUM_SEQS = 2
MAX_NUM_BATCHED_TOKENS = 1024
NUM_GPU_BLOCKS_B = 5
START_TIMEOUT_S = 240.0
# Tests that kill an engine run after every other real-engine test.
DESTRUCTIVE_MODULES = ("test_real_failover.py",)


# Which install each module needs (default: vLLM).
NEEDS = {"test_real_llamacpp.py": "llama.cpp"}
_STASH_KEY = pytest.StashKey[dict[str, list[str]]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop tests whose engine is not installed (one summary line per reason); kill last."""
    env = read_real_env()
    skip_reason = {"vLLM": env.vllm_skip, "llama.cpp": env.llamacpp_skip}
    unavailable: dict[str, list[str]] = {}
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        needs = NEEDS.get(item.path.name, "vLLM") if item.get_closest_marker("real_engine") else ""
        reason = skip_reason.get(needs, "")
        if reason:
            drop.append(item)
            unavailable.setdefault(reason, []).append(needs)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        config.stash[_STASH_KEY] = unavailable
    # The real-engine tests first (the destructive ones last among them), then the rest:
    # the shared clusters stop after the last real-engine test (``pytest_runtest_teardown``)
    # instead of scraping two CPU vLLMs every 100 ms beside every later test.
    real = [i for i in keep if i.get_closest_marker("real_engine")]
    last = [i for i in real if i.path.name in DESTRUCTIVE_MODULES]
    first = [i for i in real if i.path.name not in DESTRUCTIVE_MODULES]
    items[:] = first + last + [i for i in keep if not i.get_closest_marker("real_engine")]


_RUNNING: list[LocalCluster] = []  # the session's shared clusters, stopped early


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last real-engine test, stop the shared clusters (their fixtures' own
    exit at the end of the session then finds them stopped)."""
    if item.get_closest_marker("real_engine") is None:
        return
    if nextitem is None or nextitem.get_closest_marker("real_engine") is None:
        while _RUNNING:
            _RUNNING.pop().stop()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    for reason, engines in config.stash.get(_STASH_KEY, {}).items():
        names = ", ".join(sorted(set(engines)))
        line = f"SKIPPED {len(engines)} real-engine tests ({names} not available): {reason}"
        terminalreporter.write_line(line, yellow=True)


@dataclass(frozen=True)
class RealEnv:
    """What scripts/real_engines.sh installed (paths) and what it could not (reasons)."""

    python: str
    model_dir: str
    gguf: str
    llama_server: str
    vllm_skip: str
    llamacpp_skip: str


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiloserve"
    return Path(os.environ.get("KILOSERVE_CACHE") or default)


def read_real_env() -> RealEnv:
    if os.environ.get("KILOSERVE_REAL_ENGINES") == "0":
        off = "disabled by KILOSERVE_REAL_ENGINES=0"
        return RealEnv("", "", "", "", off, off)
    path = cache_dir() / "real-engines.env"
    if not path.exists():
        missing = f"{path} missing: run `make real-engines` (scripts/real_engines.sh) first"
        return RealEnv("", "", "", "", missing, missing)
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key] = value
    return RealEnv(
        python=values.get("KILOSERVE_REAL_PYTHON", ""),
        model_dir=values.get("KILOSERVE_REAL_MODEL", ""),
        gguf=values.get("KILOSERVE_REAL_GGUF", ""),
        llama_server=values.get("KILOSERVE_LLAMA_SERVER", ""),
        vllm_skip=values.get("KILOSERVE_VLLM_SKIP", ""),
        llamacpp_skip=values.get("KILOSERVE_LLAMACPP_SKIP", ""),
    )


@pytest.fixture(scope="session")
def real_env() -> RealEnv:
    return read_real_env()


def vllm_backend(
    name: str, env: RealEnv, core: int, num_gpu_blocks: int | None = None
) -> dict[str, Any]:
    """A cluster-YAML backend line for one vLLM CPU instance pinned to ``core``."""
    extra_args = ["--dtype", "bfloat16", "--enforce-eager"]
    if num_gpu_blocks is not None:
        extra_args += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    return {
        "name": name,
        "engine": "vllm",
        "gpu": "cpu",
        "model": SERVED_MODEL,
        "model_path": env.model_dir,
        "python": env.python,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_model_len": 512,
        "env": {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "HF_HUB_OFFLINE": "1",
        },
        "extra_args": extra_args,
    }


@pytest.fixture(scope="session")
def vllm_cluster(
    real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """vllm-a (core 0) and vllm-b (core 1), ``--max-num-seqs 2``, and the gateway."""
    if real_env.vllm_skip:
        pytest.skip(f"real vLLM unavailable: {real_env.vllm_skip}")
    cfg = parse_cluster_config(
        {
            "name": "real-vllm",
            # least_request routes on the scraped running + waiting alone, so the
            # routing test checks exactly that signal (the default policy weighs a
            # learned TTFT above it: see docs/real-engines.md).
            "gateway": {"port": 0, "policy": "least_request"},
            "backends": [
                vllm_backend("vllm-a", real_env, 0),
                # 5 KV blocks of 128 tokens (4 usable): preemption is reachable
                # (test_real_fidelity.py); every other test fits easily.
                vllm_backend("vllm-b", real_env, 1, num_gpu_blocks=NUM_GPU_BLOCKS_B),
            ],
        }
    )
    cluster = LocalCluster(
        cfg,
        run_dir=tmp_path_factory.mktemp("vllm-cluster"),
        start_timeout_s=START_TIMEOUT_S,
        # vLLM's CPU build can take over a second to render /metrics when the cores are
        # busy (its API server is not pinned); a 0.5 s scrape time-out would mark an
        # idle engine unknown and steer traffic away from it.
        # These tests count the engines' own tokens, queues and prefix-cache queries
        # exactly; the gateway's 1-token completion probe (on by default for vLLM) would
        # add its requests to vLLM's counters (docs/fault-tolerance.md), so it is off.
        gateway_options={
            "scrape_interval_s": 0.1,
            "scrape_timeout_s": 3.0,
            "stale_after_s": 10.0,
            "health": {"completion_probe": False},
        },
    )
    with cluster:
        _RUNNING.append(cluster)
        yield cluster


@pytest.fixture(scope="session")
def llamacpp_cluster(
    real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """One llama-server (4 slots), no gateway."""
    if real_env.llamacpp_skip:
        pytest.skip(f"llama.cpp unavailable: {real_env.llamacpp_skip}")
    cfg = parse_cluster_config(
        {
            "name": "real-llamacpp",
            "gateway": {"enabled": False},
            "backends": [
                {
                    "name": "llama",
                    "engine": "llama.cpp",
                    "gpu": "cpu",
                    "model": SERVED_MODEL,
                    "model_path": real_env.gguf,
                    "command": real_env.llama_server,
                    "max_num_seqs": 4,
                    "max_model_len": 512,
                    "extra_args": ["-t", "1"],
                }
            ],
        }
    )
    cluster = LocalCluster(
        cfg, run_dir=tmp_path_factory.mktemp("llamacpp"), start_timeout_s=START_TIMEOUT_S
    )
    with cluster:
        _RUNNING.append(cluster)
        yield cluster


# --- small HTTP helpers shared by the test modules -------------------------------------


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> Any:
    """GET (no body) or POST JSON; returns the decoded JSON reply."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def http_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_for(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def admin_backends(gateway_url: str) -> dict[str, dict[str, Any]]:
    rows = http_json(gateway_url + "/admin/backends")
    items = rows["backends"] if isinstance(rows, dict) else rows
    return {row["name"]: row for row in items}
