"""The cluster simulator: the gateway, its policies and many engine models in
simulated time (``kiloserve sim``; see docs/simulator.md).

Public surface: ``simulate`` and ``SimResult``; ``FaultEvent`` / ``parse_fault`` for
scheduled faults.
"""

from __future__ import annotations

from kiloserve.sim.faults import FaultEvent, load_faults, parse_fault
from kiloserve.sim.run import SimResult, simulate

__all__ = ["FaultEvent", "SimResult", "load_faults", "parse_fault", "simulate"]
