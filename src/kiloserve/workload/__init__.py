"""Workloads: deterministic request sequences shared by the bench client and the simulator.

Public surface: ``load_workload`` (from a ``--workload`` string), ``Workload`` and
``RequestSpec`` (plain data, no HTTP), the arrival modes ``OpenLoop`` / ``ClosedLoop``
and the parsers, in case a caller builds workloads programmatically.
"""

from __future__ import annotations

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
