"""``kiloserve up``'s vLLM processes ask for AMX permission at start-up
(``launch/cpu_site``): vLLM 0.32's CPU attention runs an AMX kernel without asking,
and without the permission its worker died with SIGILL (fresh-clone CI runs of the
real vLLM tests on a CPU with AMX)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiloserve.launch.config import parse_cluster_config
from kiloserve.launch.engines import engine_launch

SITE = Path(__file__).resolve().parents[3] / "src/kiloserve/launch/cpu_site"
# arch_prctl(ARCH_GET_XCOMP_PERM): the bit of XFEATURE_XTILEDATA (18) once permitted
PERMITTED = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
mask = ctypes.c_uint64(0)
assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0
print("tiles", bool(mask.value >> 18 & 1))
"""


def _has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


def test_every_vllm_launch_puts_the_site_first_and_keeps_the_rest(tmp_path: Path) -> None:
    lines = [
        {"name": "a", "engine": "vllm", "model": "m"},
        {"name": "b", "engine": "vllm", "model": "m", "env": {"PYTHONPATH": "/x:/y"}},
    ]
    a, b = parse_cluster_config({"backends": lines}).expanded()
    path_a = engine_launch(a, "127.0.0.1", 1, tmp_path).env["PYTHONPATH"].split(os.pathsep)
    assert Path(path_a[0]) == SITE and (SITE / "sitecustomize.py").is_file()
    assert path_a[1:] == [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path_b = engine_launch(b, "127.0.0.1", 1, tmp_path).env["PYTHONPATH"].split(os.pathsep)
    assert path_b[1:] == ["/x", "/y"]


@pytest.mark.skipif(not _has_amx(), reason="no AMX on this CPU")
def test_a_process_started_with_the_site_may_use_amx_tiles() -> None:
    def tiles(pythonpath: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        done = subprocess.run(
            [sys.executable, "-c", PERMITTED], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    assert tiles(None) == "tiles False"  # what a vLLM worker had before
    assert tiles(str(SITE)) == "tiles True"


def test_the_sitecustomize_it_shadows_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SHADOWED_RAN = True\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(SITE), str(tmp_path)])}
    code = "import builtins, sitecustomize; print(getattr(builtins, 'SHADOWED_RAN', False))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
