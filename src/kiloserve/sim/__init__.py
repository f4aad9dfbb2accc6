"""The cluster simulator: the gateway, its policies and many engine models in
simulated time (``kiloserve sim``; see docs/simulator.md).

Public surface: ``simulate`` and ``SimResult``; ``FaultEvent`` / ``parse_fault`` for
scheduled faults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiloserve.lazy import lazy_exports

if TYPE_CHECKING:
    from kiloserve.sim.faults import FaultEvent, load_faults, parse_fault
    from kiloserve.sim.run import SimResult, simulate

__all__ = [
    "FaultEvent",
    "SimResult",
    "load_faults",
    "parse_fault",
    "simulate",
]

_HOMES = {
    "FaultEvent": "kiloserve.sim.faults",
    "SimResult": "kiloserve.sim.run",
    "load_faults": "kiloserve.sim.faults",
    "parse_fault": "kiloserve.sim.faults",
    "simulate": "kiloserve.sim.run",
}
__getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)
