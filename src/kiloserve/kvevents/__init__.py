"""KV-cache events (vLLM's format): wire codec, exact prefix index, per-backend feeds.

* ``wire``: the msgpack ``KVEventBatch`` and ZMQ frame formats, encode and decode.
* ``index``: ``KvBlockIndex``, local block hash -> backends, kept exact by events.
* ``feed``: ``KvEventCache`` / ``BackendFeed``: sequence numbers, gaps, restarts, and
  each backend's mode (exact or approximate) for routing.
* ``inflight``: ``InFlightPrefixes``, the prompts sent to each backend and not finished
  (pinned in its engine before its events arrive), counted by ``KvEventCache``.

Pure modules (no sockets): the ZMQ publisher is the twin's (``engine.kvpublish``), the
subscriber the gateway's (``gateway.kvevents``); the simulator feeds in-process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiloserve.lazy import lazy_exports

if TYPE_CHECKING:
    from kiloserve.kvevents.feed import BackendFeed, KvEventCache
    from kiloserve.kvevents.index import KvBlockIndex
    from kiloserve.kvevents.wire import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        decode_batch,
        encode_batch,
    )

__all__ = [
    "AllBlocksCleared",
    "BackendFeed",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvBlockIndex",
    "KvEventCache",
    "decode_batch",
    "encode_batch",
]

_HOMES = {
    "AllBlocksCleared": "kiloserve.kvevents.wire",
    "BackendFeed": "kiloserve.kvevents.feed",
    "BlockRemoved": "kiloserve.kvevents.wire",
    "BlockStored": "kiloserve.kvevents.wire",
    "EventBatch": "kiloserve.kvevents.wire",
    "KvBlockIndex": "kiloserve.kvevents.index",
    "KvEventCache": "kiloserve.kvevents.feed",
    "decode_batch": "kiloserve.kvevents.wire",
    "encode_batch": "kiloserve.kvevents.wire",
}
__getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)
