"""Results of a run, shared by the bench client, the simulator and the planner.

Modules (import them directly; this package imports none of them eagerly):

* ``records``: ``RequestRecord``, ``ClientStats``, ``BenchResult`` (plain data).
* ``metrics``: ``vllm bench serve`` latency/throughput metrics, ``Slo``, ``summarize``.
* ``provenance``: what a report records so a run can be reproduced.
* ``tables``: Markdown tables for one run and for several side by side.
* ``report``: report files (``summary.json``, ``requests.jsonl``, ``summary.md``).
* ``plots``: optional PNG plots (matplotlib).
"""

from __future__ import annotations

__all__: list[str] = []
