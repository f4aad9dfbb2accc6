"""Routing without HTTP: what the gateway and the simulator share (see docs/architecture.md).

Modules (import them directly; this file imports nothing):

* ``config``: ``BackendConfig``, one backend's static configuration;
* ``table``: ``BackendTable``, every backend's live state and the snapshots policies read;
* ``engine_metrics``: ``parse_engine_metrics``, a ``/metrics`` page -> ``EngineMetrics``;
* ``router``: ``Router``, one request's routing life (decide once, dispatch, first token,
  complete -> ``Outcome``);
* ``disagg``: disaggregated prefill/decode, the split rule, the decode chooser and the
  order of whole requests over backend roles.

Nothing here imports aiohttp or prometheus_client.
"""

from __future__ import annotations
