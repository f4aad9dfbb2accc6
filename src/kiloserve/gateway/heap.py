"""Hand the C heap's free pages back to the operating system now and then (glibc).

glibc's ``malloc`` returns memory to the system only from the top of its heap: pages
freed below a live allocation stay resident. The gateway's churn (request bodies,
upstream buffers, dict tables over 512 bytes) leaves such holes, so its RSS crept up
with no live memory behind it (issue 15's soak, the prefix index capped small: RSS
+8% in 5 minutes, ``mallinfo2`` in use flat at 12 MiB and free 1.9 -> 6.5 MiB, all of
it back after one ``malloc_trim(0)``). ``trim_loop`` calls ``malloc_trim(0)`` every
``malloc_trim_interval_s`` (a millisecond or so on a gateway's heap); without glibc
(musl, macOS) there is nothing to call and the gateway skips it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import sys
from collections.abc import Callable

__all__ = ["load_malloc_trim", "trim_loop"]

Trim = Callable[[], int]


def load_malloc_trim() -> Trim | None:
    """``malloc_trim(0)`` from the C library, or None where there is none (not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int

    def trim() -> int:
        return int(fn(0))

    return trim


async def trim_loop(interval_s: float, trim: Trim) -> None:
    """``trim()`` every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        trim()
