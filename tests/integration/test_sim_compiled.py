"""The compiled build (mypyc, ``scripts/build_compiled.py``) simulates exactly what the
pure build does: byte-identical summaries (wall-clock keys aside) for the same inputs,
with every listed hot module really loaded from a C extension.

Builds ``build-compiled/`` first (a no-op when up to date; about a minute otherwise).
Each build runs in its own interpreter, as a user would run it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_compiled.py"
# One run: (policy, workload). The 1,024-GPU example scaled to 64 GPUs, as sim_speed does.
RUNS = (
    ("round_robin", "azure-conv"),
    ("default", "synthetic:input=uniform(64,900),output=uniform(8,120),prefix_groups=6"),
    ("prefix_affinity", "mooncake"),  # shared blocks, private tails, prefix hashes
)
CHILD = """
import json, sys
sys.path.insert(0, {benchmarks!r})
from sim_speed import scaled_cluster
from kiloserve.launch.config import load_cluster_config
from kiloserve.sim import simulate
from kiloserve.workload import load_workload

wall_keys = ("sim_wall_s", "sim_cpu_s", "real_time_factor", "requests_per_wall_s", "versions")
cluster = scaled_cluster(load_cluster_config({cluster!r}), 64)
summaries = []
for policy, spec in {runs!r}:
    workload = load_workload(spec, rate=20.0, num_requests=1500, with_prompts=False)
    summary = simulate(cluster, workload, policy).summary
    summaries.append({{k: v for k, v in summary.items() if k not in wall_keys}})
modules = {{}}
for name in {modules!r}:
    __import__(name)
    modules[name] = sys.modules[name].__file__
print(json.dumps({{"summaries": summaries, "modules": modules}}, sort_keys=True, default=str))
"""


def _build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_build_compiled", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compiled_dir() -> Path:
    proc = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"compiled build failed:\n{proc.stdout}\n{proc.stderr}"
    return Path(_build_script().DEFAULT_OUT_DIR)


def _simulate_in(search_path: list[str], modules: tuple[str, ...]) -> dict[str, object]:
    """Run the simulations in a fresh interpreter with ``PYTHONPATH=search_path``."""
    code = CHILD.format(
        benchmarks=str(ROOT / "benchmarks"),
        cluster=str(ROOT / "examples" / "cluster-1024.yaml"),
        runs=RUNS,
        modules=modules,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(search_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_compiled_build_gives_byte_identical_summaries(compiled_dir: Path) -> None:
    modules: tuple[str, ...] = _build_script().COMPILED_MODULES
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pure_path = [p for p in inherited if Path(p).resolve() != compiled_dir]
    pure = _simulate_in(pure_path, modules)
    compiled = _simulate_in([str(compiled_dir), *pure_path], modules)

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    compiled_files = compiled["modules"]
    pure_files = pure["modules"]
    assert isinstance(compiled_files, dict) and isinstance(pure_files, dict)
    for name in modules:
        assert compiled_files[name].endswith(suffix), (name, compiled_files[name])
        assert Path(compiled_files[name]).is_relative_to(compiled_dir)
        assert pure_files[name].endswith(".py"), (name, pure_files[name])

    pure_json = json.dumps(pure["summaries"], sort_keys=True)
    assert json.dumps(compiled["summaries"], sort_keys=True) == pure_json
    summaries = pure["summaries"]
    assert isinstance(summaries, list)
    assert [s["requests_ok"] + s["requests_failed"] for s in summaries] == [1500] * len(RUNS)
    assert all(s["requests_ok"] > 1400 for s in summaries)
