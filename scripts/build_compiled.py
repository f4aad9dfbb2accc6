"""The compiled simulator: its hot modules compiled with mypyc into C extensions.

Writes ``<root>/<hash>/`` (root: ``$KILOSERVE_CACHE/compiled``, default
``~/.cache/kiloserve/compiled``; ``<hash>``: ``kiloserve.sim.build.source_hash()``, the
compiled modules' sources and the toolchain): one ``.so`` per module in
``COMPILED_MODULES``, mypyc's shared runtime library and a stamp. ``kiloserve sim``
and ``kiloserve plan`` use it when its hash matches the current sources
(``kiloserve/sim/build.py``); an edited source runs pure Python until rebuilt. A
build that exists is not rebuilt; a failed build never leaves a half-written folder;
older builds beyond the newest few are removed. Needs mypy (mypyc), setuptools, a C
compiler and the Python headers.

``--install`` (what ``make`` runs after installing): on any failure print one line
saying the simulator runs pure Python, and exit 0. ``--check`` exits 1 when the build
is missing (builds nothing); ``--force`` rebuilds; ``--out DIR`` uses another root.
"""

from __future__ import annotations

import argparse
import fcntl
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

from kiloserve.sim.build import (
    COMPILED_MODULES,
    STAMP_NAME,
    builds_root,
    module_path,
    source_hash,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "src" / "kiloserve"
WORK_DIR = ROOT / "build" / "mypyc-work"
KEEP_BUILDS = 6  # newest builds kept under the root (other checkouts may use them)
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


def build_dir(root: Path) -> Path:
    """The folder for a build of the current sources under ``root``."""
    return root / source_hash(PACKAGE_DIR)


def is_up_to_date(root: Path) -> bool:
    """True when ``root`` holds a finished build of the current sources."""
    return (build_dir(root) / STAMP_NAME).is_file()


def check_toolchain() -> None:
    """Raise ``BuildError`` naming whatever is missing: mypyc, setuptools, cc, Python.h."""
    problems = []
    if importlib.util.find_spec("mypyc") is None:
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


def _assemble(build_lib: Path, out_tmp: Path) -> None:
    """Only the extensions: every other module still comes from the installed sources."""
    for built in build_lib.rglob("*.so"):
        target = out_tmp / built.relative_to(build_lib)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for module in COMPILED_MODULES:
        if not (out_tmp / module_path(module).with_suffix(suffix)).is_file():
            raise BuildError(f"mypyc produced no extension for {module}")


def build(root: Path, *, force: bool = False) -> bool:
    """Build into ``root/<hash>`` unless it exists; return True when it built."""
    if not force and is_up_to_date(root):
        return False
    check_toolchain()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    with (WORK_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a waiter then re-checks
        if not force and is_up_to_date(root):
            return False
        _build_locked(root)
    _prune(root)
    return True


def _build_locked(root: Path) -> None:
    stage = _stage_sources(WORK_DIR)
    stamp_hash = source_hash(stage / "kiloserve")  # what was built, even if src moves on
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".tmp-") as tmp:
        build_lib, out_tmp = Path(tmp) / "lib", Path(tmp) / "out"
        _run_mypyc(stage, build_lib, WORK_DIR / "temp")
        _assemble(build_lib, out_tmp)
        stamp = {
            "source_hash": stamp_hash,
            "modules": list(COMPILED_MODULES),
            "python": sys.version.split()[0],
            "source_dir": str(PACKAGE_DIR),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (out_tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(root / stamp_hash, ignore_errors=True)
        out_tmp.rename(root / stamp_hash)


def _prune(root: Path) -> None:
    """Keep the newest ``KEEP_BUILDS`` finished builds."""
    builds = [d for d in root.iterdir() if (d / STAMP_NAME).is_file()]
    builds.sort(key=lambda d: (d / STAMP_NAME).stat().st_mtime, reverse=True)
    for old in builds[KEEP_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="builds root (default: the cache)")
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument("--check", action="store_true", help="exit 1 if missing or stale")
    p.add_argument("--install", action="store_true", help="never fail: one line on failure")
    args = p.parse_args()
    root = (args.out or builds_root()).resolve()
    if args.check:
        ok = is_up_to_date(root)
        print(f"{build_dir(root)}: {'up to date' if ok else 'missing or stale'}")
        return 0 if ok else 1
    started = time.monotonic()
    try:
        built = build(root, force=args.force)
    except BuildError as exc:
        if args.install:
            reason = str(exc).splitlines()[0]
            print(f"kiloserve: simulator runs pure Python (no compiled build: {reason})")
            return 0
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = f"built in {time.monotonic() - started:.0f} s" if built else "up to date"
    print(f"compiled simulator {build_dir(root)}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
