"""Idempotent state moves (S3.5): register, drain, undrain, weight change.

Every move carries a ``move_id`` (a UUID) and, optionally, the ``expected_version`` the
mover last saw. A receiver

* applies a move whose ``expected_version`` is the current version (or None: "whatever
  is there now") and bumps the version;
* ignores a move whose ``move_id`` it has already applied (a retry or a duplicate): the
  answer says ``applied: false`` and nothing changes;
* refuses a move whose ``expected_version`` is not the current one (``ConflictError``,
  409), naming both versions, so the mover re-reads and decides again.

Two receivers share these rules. In etcd the version is the key's ``mod_revision`` and
the write is a transaction comparing it (``EtcdClient.put_if_revision``), so two movers
that read the same version cannot both win; the record remembers its last
``MAX_REMEMBERED_MOVES`` move ids. In the gateway (``POST /admin/backends/{name}/drain``
with ``move_id`` / ``expected_version``) ``MoveLedger`` keeps a version per backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiloserve.errors import ConflictError, RequestError, clip
from kiloserve.gateway.registry.etcd import EtcdClient
from kiloserve.gateway.registry.record import RegistryRecord, decode_record, encode_record

__all__ = [
    "MAX_REMEMBERED_MOVES",
    "MoveLedger",
    "MoveResult",
    "move_record",
    "new_move_id",
    "parse_move",
    "set_draining",
    "set_weight",
]

MAX_REMEMBERED_MOVES = 16
_MAX_ATTEMPTS = 8  # re-reads when another writer lands between our read and our write
_BACKOFF_S = 0.002  # the jittered wait before attempt n is up to this x 2**n

Change = Callable[[RegistryRecord | None], RegistryRecord]


@dataclass(frozen=True, slots=True)
class MoveResult:
    """``applied`` False: a duplicate, nothing changed; ``version``: the state's now."""

    applied: bool
    version: int

    def as_json(self) -> dict[str, Any]:
        return {"applied": self.applied, "version": self.version}


def new_move_id() -> str:
    return str(uuid.uuid4())


def parse_move(body: Any) -> tuple[str | None, int | None]:
    """(``move_id``, ``expected_version``) of an admin request body (both optional);
    a 400 naming the field when one is malformed."""
    if body is None:
        return None, None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    move_id, expected = body.get("move_id"), body.get("expected_version")
    if move_id is not None:
        try:
            move_id = str(uuid.UUID(str(move_id)))
        except ValueError as exc:
            raise RequestError(
                f"'move_id' must be a UUID, got {clip(str(move_id), 64)!r}", param="move_id"
            ) from exc
    if expected is not None and (
        isinstance(expected, bool) or not isinstance(expected, int) or expected < 0
    ):
        raise RequestError("'expected_version' must be an integer >= 0", param="expected_version")
    return move_id, expected


def _stale(what: str, expected: int, current: int) -> ConflictError:
    return ConflictError(
        f"stale state move on {what}: expected version {expected}, it is at version "
        f"{current}; read it again and retry with the current version",
        code="stale_version",
    )


class MoveLedger:
    """Versions and recent move ids per name, for moves applied in this process."""

    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._seen: dict[str, deque[str]] = {}

    def version(self, name: str) -> int:
        return self._versions.get(name, 0)

    def move(
        self, name: str, move_id: str | None, expected: int | None, apply: Callable[[], None]
    ) -> MoveResult:
        """Apply ``apply`` under the rules above (ConflictError when stale)."""
        seen = self._seen.setdefault(name, deque(maxlen=MAX_REMEMBERED_MOVES))
        current = self.version(name)
        if move_id is not None and move_id in seen:
            return MoveResult(False, current)
        if expected is not None and expected != current:
            raise _stale(name, expected, current)
        apply()
        if move_id is not None:
            seen.append(move_id)
        self._versions[name] = current + 1
        return MoveResult(True, current + 1)


def _with_move(record: RegistryRecord, previous: RegistryRecord | None, move_id: str) -> bytes:
    kept = previous.move_ids if previous is not None else ()
    ids = (*kept, move_id)[-MAX_REMEMBERED_MOVES:]
    return encode_record(dataclasses.replace(record, move_ids=ids))


async def move_record(
    client: EtcdClient,
    key: str,
    change: Change,
    *,
    move_id: str,
    expected_version: int | None = None,
    lease_id: int | None = None,
) -> MoveResult:
    """Apply ``change`` to the record at ``key`` in one etcd transaction on its
    ``mod_revision``. ``lease_id`` None keeps the key's lease (a move by someone other
    than the agent that holds it). ConflictError when stale; EtcdError when etcd fails."""
    for attempt in range(_MAX_ATTEMPTS):
        if attempt:  # another writer won the last round: back off a random bit
            await asyncio.sleep(random.uniform(0.0, _BACKOFF_S * 2**attempt))
        version, raw = await client.get_one(key)
        current = decode_record(raw, key) if raw is not None else None
        if current is not None and move_id in current.move_ids:
            return MoveResult(False, version)
        if expected_version is not None and expected_version != version:
            raise _stale(key, expected_version, version)
        value = _with_move(change(current), current, move_id)
        is_done, new_version = await client.put_if_revision(key, value, version, lease_id)
        if is_done:
            return MoveResult(True, new_version)
    raise ConflictError(
        f"{key} kept changing under {_MAX_ATTEMPTS} attempts; retry", code="stale_version"
    )


def _existing(key: str, current: RegistryRecord | None) -> RegistryRecord:
    if current is None:
        raise ConflictError(f"no backend registered at {key}", code="not_registered")
    return current


async def set_draining(
    client: EtcdClient, key: str, draining: bool, *, move_id: str, expected_version: int | None
) -> MoveResult:
    """Drain (or undrain) the registered backend at ``key``."""

    def change(current: RegistryRecord | None) -> RegistryRecord:
        return dataclasses.replace(_existing(key, current), is_draining=draining)

    return await move_record(
        client, key, change, move_id=move_id, expected_version=expected_version
    )


async def set_weight(
    client: EtcdClient, key: str, weight: float, *, move_id: str, expected_version: int | None
) -> MoveResult:
    """Change the routing weight of the registered backend at ``key``."""
    if not weight >= 0.0:
        raise RequestError(f"weight must be >= 0, got {weight}", param="weight")

    def change(current: RegistryRecord | None) -> RegistryRecord:
        record = _existing(key, current)
        backend = record.backend.model_copy(update={"weight": weight})
        return dataclasses.replace(record, backend=backend)

    return await move_record(
        client, key, change, move_id=move_id, expected_version=expected_version
    )
