"""The layering holds at run time too: the simulator and the routing core load no HTTP stack."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "kiloserve"

_PROBE = (
    "import sys, importlib; importlib.import_module({module!r}); "
    "print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r})))"
)
_HEAVY = {"aiohttp", "prometheus_client", "etcd3", "redis", "matplotlib", "zmq", "jinja2"}


@pytest.mark.parametrize(
    "module",
    [
        "kiloserve.sim.simulator",
        "kiloserve.sim.run",
        "kiloserve.routing.router",
        "kiloserve.routing.table",
        "kiloserve.gateway.config",
        "kiloserve.policies.registry",
    ],
)
def test_module_loads_no_http_stack(module: str) -> None:
    code = _PROBE.format(module=module, heavy=_HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", f"importing {module} loads {out.stdout.strip()}"


_ALLOWED_IN_INIT = {"__future__", "typing", "kiloserve.lazy"}


def _eager_imports(tree: ast.Module) -> list[str]:
    """Top-level imports of a module, outside ``if TYPE_CHECKING:`` blocks."""
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            found.append(node.module or ".")
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [name for name in found if name not in _ALLOWED_IN_INIT]


@pytest.mark.parametrize(
    "init", sorted(SRC.rglob("__init__.py")), ids=lambda p: str(p.parent.relative_to(SRC))
)
def test_package_init_imports_nothing_eagerly(init: Path) -> None:
    eager = _eager_imports(ast.parse(init.read_text()))
    assert eager == [], f"{init} imports {eager} eagerly (use kiloserve.lazy.lazy_exports)"


def test_lazy_exports_resolve_every_public_name() -> None:
    for init in sorted(SRC.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(SRC.parent).parts)
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            assert getattr(module, name) is not None, f"{package}.{name}"
