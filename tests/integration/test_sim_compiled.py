"""The compiled build (mypyc, ``scripts/build_compiled.py``) simulates exactly what the
pure build does: byte-identical summaries (wall-clock keys aside) for the same inputs,
with every listed hot module really loaded from a C extension; ``kiloserve sim`` runs
it by default, says so, and falls back to pure Python when no build matches the sources.

Builds into the cache first (a no-op when up to date; two minutes otherwise). Each
build runs in its own interpreter, as a user would run it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kiloserve.sim.build import COMPILED_MODULES, find_build, source_hash

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_compiled.py"
# One run: (policy, workload). The 1,024-GPU example scaled to 64 GPUs, as sim_speed does.
RUNS = (
    ("round_robin", "azure-conv"),
    ("default", "synthetic:input=uniform(64,900),output=uniform(8,120),prefix_groups=6"),
    ("prefix_affinity", "mooncake"),  # shared blocks, private tails, prefix hashes
    ("default", "mooncake"),  # the compiled scorers and in-flight prefixes (exact backends)
)
CHILD = """
import json, sys
sys.path.insert(0, {benchmarks!r})
from kiloserve.sim.build import select_build
print(select_build({mode!r}), file=sys.stderr)
from sim_speed import scaled_cluster
from kiloserve.launch.config import load_cluster_config
from kiloserve.sim import simulate
from kiloserve.workload import load_workload

cluster = scaled_cluster(load_cluster_config({cluster!r}), 64)
summaries = []
for policy, spec in {runs!r}:
    workload = load_workload(spec, rate=20.0, num_requests=1500, with_prompts=False)
    summary = simulate(cluster, workload, policy).summary
    summaries.append({{k: v for k, v in summary.items() if k not in {wall_keys!r}}})
modules = {{}}
for name in {modules!r}:
    __import__(name)
    modules[name] = sys.modules[name].__file__
print(json.dumps({{"summaries": summaries, "modules": modules}}, sort_keys=True, default=str))
"""


WALL_KEYS = ("sim_wall_s", "sim_cpu_s", "real_time_factor", "requests_per_wall_s", "versions")
COMPILED_LINE = "simulator: compiled (mypyc)"
SIM_ARGS = ("--workload", "azure-conv", "--rate", "8", "--num-requests", "400", "--no-plots")


@pytest.fixture(scope="module")
def compiled_dir() -> Path:
    for _ in range(2):  # twice: a source edited during the build makes it stale at once
        proc = subprocess.run(
            [sys.executable, str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=400
        )
        assert proc.returncode == 0, f"compiled build failed:\n{proc.stdout}\n{proc.stderr}"
        if (found := find_build()) is not None:
            return found
    raise AssertionError(f"no build of the current sources after building: {proc.stdout}")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KILOSERVE_SIM_BUILD"}
    return {**env, **extra}


def _simulate_in(mode: str, modules: tuple[str, ...]) -> dict[str, object]:
    """Run the simulations in a fresh interpreter with the build ``mode`` selected."""
    code = CHILD.format(
        benchmarks=str(ROOT / "benchmarks"),
        cluster=str(ROOT / "examples" / "cluster-1024.yaml"),
        runs=RUNS,
        modules=modules,
        mode=mode,
        wall_keys=WALL_KEYS,
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def _kiloserve_sim(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kiloserve sim`` as a user runs it: the console script, its own process."""
    out.mkdir(parents=True)  # the same relative --out, so the recorded commands are equal
    cmd = [str(Path(sys.executable).parent / "kiloserve"), "sim",
           "-c", str(ROOT / "examples" / "cluster.yaml"), *SIM_ARGS, "--out", "sim"]  # fmt: skip
    return subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def _summary(out: Path) -> str:
    files = sorted(out.glob("sim/*/summary.json"))
    assert len(files) == 1, files
    summary = json.loads(files[0].read_text())
    return json.dumps({k: v for k, v in summary.items() if k not in WALL_KEYS}, sort_keys=True)


def test_compiled_build_gives_byte_identical_summaries(compiled_dir: Path) -> None:
    modules = COMPILED_MODULES
    pure = _simulate_in("pure", modules)
    compiled = _simulate_in("compiled", modules)

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


def test_kiloserve_sim_runs_the_compiled_build_by_default(
    compiled_dir: Path, tmp_path: Path
) -> None:
    default = _kiloserve_sim(tmp_path / "default", _env())
    assert default.returncode == 0, default.stderr
    assert COMPILED_LINE in default.stderr
    pure = _kiloserve_sim(tmp_path / "pure", _env(KILOSERVE_SIM_BUILD="pure"))
    assert pure.returncode == 0, pure.stderr
    assert "simulator: pure Python (KILOSERVE_SIM_BUILD=pure)" in pure.stderr
    assert _summary(tmp_path / "default") == _summary(tmp_path / "pure")


def test_a_build_of_other_sources_is_not_used(compiled_dir: Path, tmp_path: Path) -> None:
    """A build keyed by an edited source's hash is stale: pure Python runs, and says so."""
    edited = tmp_path / "src" / "kiloserve"
    shutil.copytree(
        ROOT / "src" / "kiloserve", edited, ignore=shutil.ignore_patterns("__pycache__")
    )
    with (edited / "sim" / "simulator.py").open("a") as f:
        f.write("# an edit after the build\n")
    stale_hash = source_hash(edited)
    assert stale_hash != compiled_dir.name
    cache = tmp_path / "cache"
    (cache / "compiled").mkdir(parents=True)
    (cache / "compiled" / stale_hash).symlink_to(compiled_dir, target_is_directory=True)

    stale = _kiloserve_sim(tmp_path / "stale", _env(KILOSERVE_CACHE=str(cache)))
    assert stale.returncode == 0, stale.stderr
    assert "simulator: pure Python (no compiled build: run make compiled)" in stale.stderr
    forced = _kiloserve_sim(tmp_path / "forced", _env(KILOSERVE_CACHE=str(cache),
                                                      KILOSERVE_SIM_BUILD="compiled"))  # fmt: skip
    assert forced.returncode == 2
    assert "KILOSERVE_SIM_BUILD=compiled, but no compiled build" in forced.stderr

    (cache / "compiled" / compiled_dir.name).symlink_to(compiled_dir, target_is_directory=True)
    current = _kiloserve_sim(tmp_path / "current", _env(KILOSERVE_CACHE=str(cache)))
    assert COMPILED_LINE in current.stderr
    assert _summary(tmp_path / "current") == _summary(tmp_path / "stale")
