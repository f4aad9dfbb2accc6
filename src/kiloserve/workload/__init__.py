"""Workloads: deterministic request sequences shared by the bench client and the simulator.

Public surface: ``load_workload`` (from a ``--workload`` string), ``Workload`` and
``RequestSpec`` (plain data, no HTTP), the arrival modes ``OpenLoop`` / ``ClosedLoop``
and the parsers, in case a caller builds workloads programmatically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiloserve.lazy import lazy_exports

if TYPE_CHECKING:
    from kiloserve.workload.arrivals import (
        ArrivalMode,
        ClosedLoop,
        OpenLoop,
        constant_arrivals,
        request_rate_arrivals,
        trace_arrivals,
    )
    from kiloserve.workload.loader import load_workload
    from kiloserve.workload.request import RequestSpec, Workload
    from kiloserve.workload.spec import TRACE_NAMES, parse_workload_spec
    from kiloserve.workload.synthetic import PRESETS
    from kiloserve.workload.traces import find_traces_dir, read_trace

__all__ = [
    "PRESETS",
    "TRACE_NAMES",
    "ArrivalMode",
    "ClosedLoop",
    "OpenLoop",
    "RequestSpec",
    "Workload",
    "constant_arrivals",
    "find_traces_dir",
    "load_workload",
    "parse_workload_spec",
    "read_trace",
    "request_rate_arrivals",
    "trace_arrivals",
]

_HOMES = {
    "PRESETS": "kiloserve.workload.synthetic",
    "TRACE_NAMES": "kiloserve.workload.spec",
    "ArrivalMode": "kiloserve.workload.arrivals",
    "ClosedLoop": "kiloserve.workload.arrivals",
    "OpenLoop": "kiloserve.workload.arrivals",
    "RequestSpec": "kiloserve.workload.request",
    "Workload": "kiloserve.workload.request",
    "constant_arrivals": "kiloserve.workload.arrivals",
    "find_traces_dir": "kiloserve.workload.traces",
    "load_workload": "kiloserve.workload.loader",
    "parse_workload_spec": "kiloserve.workload.spec",
    "read_trace": "kiloserve.workload.traces",
    "request_rate_arrivals": "kiloserve.workload.arrivals",
    "trace_arrivals": "kiloserve.workload.arrivals",
}
__getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)
