"""Which simulator build runs: the mypyc-compiled hot modules, or pure Python.

``scripts/build_compiled.py`` (run by ``make`` at install time, and by ``make
compiled``) compiles ``COMPILED_MODULES`` into C extensions under
``builds_root()/<hash>/``, where ``<hash>`` is ``source_hash()``: the compiled modules'
sources, the Python and mypy versions and ``BUILD_FORMAT``. An edited source has a new
hash, so it never runs a stale build: it runs pure Python until rebuilt.

``select_build()`` picks the build before the simulator is imported: with a build that
matches the current sources it puts an import hook first on ``sys.meta_path`` that
loads exactly those modules from their ``.so`` files (everything else, package data
included, still comes from the installed sources), imports the simulator and returns
the line to print (``simulator: compiled (mypyc)`` or ``simulator: pure Python (...)``).
``KILOSERVE_SIM_BUILD=pure|compiled|auto`` (default ``auto``) forces a build;
``compiled`` without a matching build is an error. ``kiloserve sim`` and ``kiloserve
plan`` call it; library users call it before importing ``kiloserve.sim.run``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from kiloserve.errors import ConfigError

__all__ = [
    "COMPILED_MODULES",
    "ENV_VAR",
    "STAMP_NAME",
    "builds_root",
    "describe_loaded",
    "find_build",
    "loaded_build",
    "select_build",
    "source_hash",
]

ENV_VAR = "KILOSERVE_SIM_BUILD"
MODES = ("auto", "compiled", "pure")
STAMP_NAME = "BUILD-STAMP.json"
BUILD_FORMAT = "2"  # bump when scripts/build_compiled.py changes what it produces
PACKAGE_DIR = Path(__file__).resolve().parents[1]
PURE_HINT = "no compiled build: run make compiled"
# The simulator's hot path. Rules for these modules (docs/simulator.md, "Compiled
# build"): no @runtime_checkable Protocols, no interpreted subclasses of their classes,
# no vars()/__dict__ on their instances, no paths derived from their own __file__.
COMPILED_MODULES = (
    "kiloserve.engine.sequence",
    "kiloserve.engine.block_manager",
    "kiloserve.engine.scheduler",
    "kiloserve.engine.kv_tiers",
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
    "kiloserve.sim.kvevents",
    "kiloserve.sim.demotion",
    "kiloserve.gateway.resilience.slow_nodes",
    "kiloserve.kvevents.index",
    "kiloserve.kvevents.inflight",
    "kiloserve.policies.signals",
    "kiloserve.policies.round_robin",
    "kiloserve.policies.base",
    "kiloserve.policies.accounting",
    "kiloserve.policies.scorers",
    "kiloserve.routing.table",
    "kiloserve.routing.engine_metrics",
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
_PROBE = "kiloserve.sim.simulator"  # imported to check which build loaded


def module_path(module: str) -> Path:
    """``kiloserve.engine.core`` -> ``kiloserve/engine/core.py`` (relative)."""
    return Path(*module.split(".")).with_suffix(".py")


def builds_root() -> Path:
    """Where builds live: ``$KILOSERVE_CACHE/compiled`` (default ``~/.cache/kiloserve``)."""
    cache = os.environ.get("KILOSERVE_CACHE") or str(Path.home() / ".cache" / "kiloserve")
    return Path(cache) / "compiled"


def source_hash(package_dir: Path = PACKAGE_DIR) -> str:
    """Hash of what a build depends on: the compiled modules' sources and the toolchain."""
    digest = hashlib.sha256()
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
    digest.update(f"{BUILD_FORMAT}|{sys.version}|{ext_suffix}|{_mypy_version()}".encode())
    for module in COMPILED_MODULES:
        digest.update(module.encode() + b"\0")
        digest.update((package_dir.parent / module_path(module)).read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def _mypy_version() -> str:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def find_build(root: Path | None = None) -> Path | None:
    """The finished build of the current sources, or None."""
    directory = (root or builds_root()) / source_hash()
    return directory if (directory / STAMP_NAME).is_file() else None


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and mypyc's shared library) in one build folder."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname in COMPILED_MODULES:
            file = self.directory / module_path(fullname).with_suffix(self.suffix)
        elif fullname.endswith("__mypyc") and "." not in fullname:
            file = self.directory / (fullname + self.suffix)
        else:
            return None
        return importlib.util.spec_from_file_location(fullname, file) if file.is_file() else None


def loaded_build() -> str:
    """``compiled`` or ``pure``: the build the imported simulator came from."""
    file = getattr(importlib.import_module(_PROBE), "__file__", None) or ""
    return "pure" if file.endswith(".py") else "compiled"


def describe_loaded() -> str:
    """The line for a process that does not choose its build (``select_build`` does)."""
    if loaded_build() == "compiled":
        return "simulator: compiled (mypyc)"
    return _line("in-process run: the kiloserve command loads the compiled build")


def select_build(mode: str | None = None, root: Path | None = None) -> str:
    """Use the compiled build if wanted and present; return the line saying which runs."""
    mode = mode if mode is not None else (os.environ.get(ENV_VAR) or "auto")
    if mode not in MODES:
        raise ConfigError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    directory = None if mode == "pure" else find_build(root)
    if directory is None:
        if mode == "compiled":
            raise ConfigError(f"{ENV_VAR}=compiled, but {PURE_HINT}")
        reason = f"{ENV_VAR}=pure" if mode == "pure" else PURE_HINT
        return _line(reason)
    if not any(m in sys.modules for m in COMPILED_MODULES):
        sys.meta_path.insert(0, _CompiledFinder(directory))
    if loaded_build() == "compiled":
        return "simulator: compiled (mypyc)"
    if mode == "compiled":
        raise ConfigError(f"{ENV_VAR}=compiled, but the simulator was imported before")
    return _line("the simulator was imported before the compiled build could load")


def _line(reason: str) -> str:
    return f"simulator: pure Python ({reason})"
