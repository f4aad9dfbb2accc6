"""vLLM's KV-cache event wire format (``--kv-events-config``), both ways.

A publisher sends ZMQ multipart messages ``(topic, seq, payload)``: ``seq`` is an
8-byte big-endian sequence number (0 at publisher start, +1 per batch) and ``payload``
a msgpack ``KVEventBatch``: an array ``[ts, events, data_parallel_rank]``. Each event
is a map tagged by its ``type`` (vLLM 0.11+; ``omit_defaults`` drops ``None`` and
default fields) or, from older publishers, an array whose first item is the tag:

* ``BlockStored``: ``block_hashes`` (the engine's hashes, int or bytes),
  ``parent_block_hash`` (``None`` for a prompt's first block), ``token_ids`` (the
  stored blocks' tokens, concatenated), ``block_size``, ``lora_id``, ``medium``
  (``"GPU"``, ``"CPU"``, ...), ``lora_name`` and ``extra_keys`` (per block: the LoRA
  name when set, ``[mm_identifier, offset]`` pairs, the cache salt, embedding digests);
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``.

The replay socket (ZMQ ROUTER) answers a request ``("", start_seq)`` from a DEALER
with ``("", topic, seq, payload)`` for every buffered batch from ``start_seq`` on,
then ``("", "", END_SEQ, "")``. Decoding is tolerant (unknown fields are ignored, an
unknown event type is skipped) and strict where it matters: a payload that is not a
batch raises ``KvEventError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kiloserve.errors import KvEventError

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "Event",
    "EventBatch",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

EngineHash = int | bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def _event_map(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        return out
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM's ``ZmqEventPublisher`` sends for ``batch``."""
    events = [_event_map(e) for e in batch.events]
    body: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return _ENCODER.encode(body)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise KvEventError(f"block hash must be an int or bytes, got {type(value).__name__}")
    return value


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list):
        raise KvEventError("block_hashes must be an array")
    return tuple(_hash(v) for v in value)


def _extra_keys(value: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise KvEventError("extra_keys must be an array")
    return tuple(None if k is None else tuple(k) if isinstance(k, list) else (k,) for k in value)


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _as_map(raw: Any) -> dict[str, Any] | None:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        names = _ARRAY_FIELDS.get(raw[0])
        if names is None:
            return None
        return {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    raise KvEventError("an event must be a map or a tagged array")


def _event(raw: Any) -> Event | None:
    fields = _as_map(raw)
    if fields is None:
        return None
    kind = fields.get("type")
    if kind == "BlockStored":
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids")
        size = fields.get("block_size")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise KvEventError("token_ids must be an array of ints")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise KvEventError("block_size must be a positive int")
        lora_name = fields.get("lora_name")
        lora_id = fields.get("lora_id")
        medium = fields.get("medium")
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(tokens),
            block_size=size,
            lora_name=lora_name if isinstance(lora_name, str) else None,
            medium=medium if isinstance(medium, str) else None,
            extra_keys=_extra_keys(fields.get("extra_keys")),
            lora_id=lora_id if isinstance(lora_id, int) else None,
        )
    if kind == "BlockRemoved":
        medium = fields.get("medium")
        return BlockRemoved(
            _hashes(fields.get("block_hashes")), medium if isinstance(medium, str) else None
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer event type: skipped


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one batch payload (``KvEventError`` if it is not a ``KVEventBatch``)."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventError("a batch must be an array [ts, events, data_parallel_rank]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvEventError("batch ts must be a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events = tuple(e for e in (_event(r) for r in raw[1]) if e is not None)
    return EventBatch(float(ts), events, rank)
