"""The layering holds at run time too: the simulator and the routing core load no HTTP stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = (
    "import sys, importlib; importlib.import_module({module!r}); "
    "print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r})))"
)
_HEAVY = {"aiohttp", "prometheus_client", "etcd3", "redis", "matplotlib"}


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
