"""Fault tolerance: keep serving while engines crash, hang, slow down or flap
(docs/fault-tolerance.md). Each module is imported on its own (this file imports none):

* ``health``: the ``health:`` config and ``ProbeTracker``, probe streaks -> verdict (pure);
* ``prober``: the active probe loops, one jittered loop per backend (aiohttp);
* ``outlier``: passive outlier detection and the circuit breaker (pure, time passed in);
* ``demotion``: slow-node demotion and slow start (pure, time passed in);
* ``manager``: ``Resilience``, the glue that feeds them from live traffic and writes their
  verdicts (vetoes, effective weights) into the ``BackendTable``.
"""
