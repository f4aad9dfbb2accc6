"""Start-up hook of the vLLM processes ``kiloserve up`` starts (see ``__init__``).

On a CPU with AMX (Intel Sapphire Rapids and later), Linux lets a process use the AMX
tile registers only after it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); an AMX instruction before that raises SIGILL. vLLM 0.32's CPU
attention runs an AMX kernel for bf16 whenever the CPU has AMX
(``vllm/v1/attention/backends/cpu_attn.py``), but nothing in the worker asks: it works
only when oneDNN happened to ask first (for an AMX matmul), and otherwise the worker
dies at its first forward ("Fatal Python error: Illegal instruction" in
``cpu_attention_with_kv_cache``, exit code -4; seen in fresh-clone CI runs of the real
vLLM tests: the NIXL pair every time, the LoRA and prefix tests now and then). Each
process asks here, at start-up; where there is no AMX (or not Linux x86-64) the call
fails and nothing changes. Then the ``sitecustomize`` this one shadows runs, if any.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import platform
import sys

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def amx_permission() -> bool:
    """Ask for AMX tile permission for this process; True when granted."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def _run_shadowed() -> None:
    """The next ``sitecustomize`` on ``sys.path`` (this folder's shadows it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


amx_permission()
_run_shadowed()
