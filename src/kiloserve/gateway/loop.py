"""The gateway's event loop: uvloop where installed, else the standard library's.

uvloop (libuv under asyncio's API) cuts the loop's own cost per request: socket
readiness, callbacks and transports are C. ``event_loop: auto`` (the default, and
``kiloserve gateway --loop auto``) uses it when it imports and falls back to asyncio's
loop with one log line; ``uvloop`` insists (an error when it is missing), ``asyncio``
never uses it. The figures are in docs/gateway.md ("Event loop"), measured with
``benchmarks/gateway_overhead.py``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable

__all__ = ["LoopError", "loop_factory"]

logger = logging.getLogger(__name__)


class LoopError(RuntimeError):
    """``event_loop: uvloop`` when uvloop is not installed."""


def loop_factory(name: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """(factory for ``asyncio.Runner``, the loop's name); factory None: asyncio's own."""
    if name == "asyncio":
        return None, "asyncio"
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError as exc:
        if name == "uvloop":
            raise LoopError(
                "event_loop: uvloop, but uvloop is not installed (pip install uvloop)"
            ) from exc
        logger.info("uvloop is not installed: the standard asyncio event loop serves")
        return None, "asyncio"
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory, "uvloop"
