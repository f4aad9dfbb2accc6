"""Opt-in compiled build: the simulator's hot modules compiled with mypyc.

Writes a complete importable ``kiloserve`` package to ``build-compiled/`` (gitignored):
every file of ``src/kiloserve`` (sources and package data) with the modules in
``COMPILED_MODULES`` replaced by C extensions (``.so``), plus mypyc's shared runtime
library next to the package. Use it by prepending it to ``PYTHONPATH``::

    python scripts/build_compiled.py            # build, or nothing if up to date
    PYTHONPATH=build-compiled .venv/bin/kiloserve sim ...

The editable install (``src/``) is untouched: without ``PYTHONPATH`` nothing changes.
The build is stamped with a hash of every file under ``src/kiloserve``, this script,
and the Python and mypy versions; it rebuilds only when the stamp differs, and a
failed build never leaves a half-written ``build-compiled/``. Needs mypy (mypyc, in
the ``dev`` and ``compiled`` extras), setuptools, a C compiler and the Python headers.

``--check`` exits 1 when the build is missing or stale (builds nothing); ``--force``
rebuilds even when up to date; ``--out DIR`` writes elsewhere.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "src" / "kiloserve"
# Beside src/ (not under build/): kiloserve finds the repo (demo assets, the shared
# traces folder) at a fixed depth above its own files, so the package's depth must match.
DEFAULT_OUT_DIR = ROOT / "build-compiled"
WORK_DIR = ROOT / "build" / "mypyc-work"
STAMP_NAME = "BUILD-STAMP.json"
# The simulator's hot path. Rules for these modules (docs/simulator.md, "Compiled
# build"): no @runtime_checkable Protocols, no interpreted subclasses of their classes,
# no vars()/__dict__ on their instances.
COMPILED_MODULES = (
    "kiloserve.engine.sequence",
    "kiloserve.engine.block_manager",
    "kiloserve.engine.scheduler",
    "kiloserve.engine.core",
    "kiloserve.engine.timing",
    "kiloserve.sim.sequence",
    "kiloserve.sim.backend",
    "kiloserve.sim.simulator",
    "kiloserve.sim.events",
    "kiloserve.sim.gateway",
    "kiloserve.sim.request",
    "kiloserve.sim.results",
    "kiloserve.sim.prompts",
    "kiloserve.policies.signals",
    "kiloserve.policies.round_robin",
    "kiloserve.policies.base",
    "kiloserve.policies.accounting",
    "kiloserve.routing.table",
    "kiloserve.routing.router",
    "kiloserve.sim.cluster",
    "kiloserve.sim.run",
    "kiloserve.workload.traces",
    "kiloserve.bench.stream",
    "kiloserve.workload.digest",
    "kiloserve.workload.synthetic",
    "kiloserve.workload.arrivals",
    "kiloserve.workload.request",
    "kiloserve.values",
)
# Run by a fresh interpreter in the work dir: argv = build_lib, build_temp, module paths.
SETUP_CODE = """
import sys
from mypyc.build import mypycify
from setuptools import setup
build_lib, build_temp, *paths = sys.argv[1:]
sys.argv = [sys.argv[0], "build_ext", "--build-lib", build_lib, "--build-temp", build_temp]
setup(name="kiloserve-compiled", ext_modules=mypycify(paths, opt_level="3", debug_level="1"))
"""


class BuildError(Exception):
    """The compiled build cannot be made; the message says why and what to do."""


def module_path(module: str) -> Path:
    """``kiloserve.engine.core`` -> ``kiloserve/engine/core.py`` (relative)."""
    return Path(*module.split(".")).with_suffix(".py")


def _source_files(package_dir: Path) -> list[Path]:
    return sorted(p for p in package_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def source_hash(package_dir: Path = PACKAGE_DIR) -> str:
    """Hash of everything the build depends on: sources, this script, toolchain versions."""
    digest = hashlib.sha256()
    digest.update(f"{sys.version}|{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    digest.update(_mypy_version().encode())
    digest.update(Path(__file__).read_bytes())
    for path in _source_files(package_dir):
        digest.update(str(path.relative_to(package_dir)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _mypy_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return "missing"
    return __version__


def is_up_to_date(out_dir: Path) -> bool:
    """True when ``out_dir`` holds a finished build of the current sources."""
    stamp = out_dir / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except ValueError:
        return False
    return bool(recorded.get("source_hash") == source_hash())


def check_toolchain() -> None:
    """Raise ``BuildError`` naming whatever is missing: mypyc, setuptools, cc, Python.h."""
    problems = []
    if _mypy_version() == "missing":
        problems.append("mypy (provides mypyc): .venv/bin/pip install 'mypy>=1.10'")
    if importlib.util.find_spec("setuptools") is None:
        problems.append("setuptools: .venv/bin/pip install setuptools")
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(cc) is None:
        problems.append(f"a C compiler ({cc!r} not on PATH): e.g. apt-get install gcc")
    include_dir = Path(sysconfig.get_paths()["include"])
    if not (include_dir / "Python.h").is_file():
        problems.append(
            f"the Python headers ({include_dir}/Python.h missing): e.g. apt-get install python3-dev"
        )
    if problems:
        raise BuildError("compiled build needs: " + "; ".join(problems))


def _stage_sources(work_dir: Path) -> Path:
    """Copy ``src/kiloserve`` into the work dir (mypyc writes its C files there)."""
    stage = work_dir / "src"
    shutil.rmtree(stage / "kiloserve", ignore_errors=True)
    shutil.copytree(PACKAGE_DIR, stage / "kiloserve", ignore=shutil.ignore_patterns("__pycache__"))
    return stage


def _run_mypyc(stage: Path, build_lib: Path, build_temp: Path) -> None:
    paths = ["--config-file", str(ROOT / "pyproject.toml")]
    paths += [str(module_path(m)) for m in COMPILED_MODULES]
    cmd = [sys.executable, "-c", SETUP_CODE, str(build_lib), str(build_temp), *paths]
    log_path = stage.parent / "build.log"
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=stage, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise BuildError(f"mypyc build failed (full log: {log_path}):\n{tail}")


def _assemble(stage: Path, build_lib: Path, out_tmp: Path) -> None:
    """The package: the staged sources, the .so modules instead of their .py files."""
    shutil.copytree(
        stage / "kiloserve", out_tmp / "kiloserve", ignore=shutil.ignore_patterns("__pycache__")
    )
    for built in build_lib.rglob("*.so"):
        target = out_tmp / built.relative_to(build_lib)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for module in COMPILED_MODULES:
        rel = module_path(module)
        if not (out_tmp / rel.with_suffix(suffix)).is_file():
            raise BuildError(f"mypyc produced no extension for {module}")
        (out_tmp / rel).unlink()


def build(out_dir: Path, *, force: bool = False) -> bool:
    """Build into ``out_dir`` unless up to date; return True when it built."""
    if not force and is_up_to_date(out_dir):
        return False
    check_toolchain()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    with (WORK_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a waiter then re-checks
        if not force and is_up_to_date(out_dir):
            return False
        _build_locked(out_dir)
    return True


def _build_locked(out_dir: Path) -> None:
    stage = _stage_sources(WORK_DIR)
    stamp_hash = source_hash(stage / "kiloserve")  # what was built, even if src moves on
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK_DIR, prefix="out-") as tmp:
        build_lib, out_tmp = Path(tmp) / "lib", Path(tmp) / "out"
        _run_mypyc(stage, build_lib, WORK_DIR / "temp")
        _assemble(stage, build_lib, out_tmp)
        stamp = {
            "source_hash": stamp_hash,
            "modules": list(COMPILED_MODULES),
            "python": sys.version.split()[0],
            "mypy": _mypy_version(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (out_tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        out_tmp.rename(out_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="output directory")
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument("--check", action="store_true", help="exit 1 if missing or stale")
    args = p.parse_args()
    out_dir = args.out.resolve()
    if args.check:
        ok = is_up_to_date(out_dir)
        print(f"{out_dir}: {'up to date' if ok else 'missing or stale'}")
        return 0 if ok else 1
    started = time.monotonic()
    try:
        built = build(out_dir, force=args.force)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = f"built in {time.monotonic() - started:.0f} s" if built else "up to date"
    print(f"{out_dir}: {what}; use PYTHONPATH={out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
