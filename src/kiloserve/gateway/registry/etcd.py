"""A small etcd v3 client over etcd's JSON gRPC gateway (``/v3/...``), on aiohttp.

Why not a PyPI client: ``etcd3`` is unmaintained and breaks with protobuf 4+, and the
newer ones are bindings to native code; etcd serves its v3 API as JSON over HTTP on the
client port (every etcd >= 3.4, Debian's ``etcd-server`` included), which is all the
registry needs: range, put, delete, leases and a streaming watch. Keys and values are
base64 in that API; this module takes and returns ``str`` keys and ``bytes`` values.

Every call tries the endpoints in order and raises ``EtcdError`` when none answers.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kiloserve.errors import EtcdError

__all__ = ["EtcdClient", "WatchEvent", "prefix_end"]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A key was put (``value`` set) or deleted (``value`` None) at ``revision``."""

    key: str
    value: bytes | None
    revision: int


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> bytes:
    """The ``range_end`` covering every key that starts with ``prefix`` (UTF-8 bytes)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


def _event(ev: dict[str, Any]) -> WatchEvent:
    kv = ev.get("kv", {})
    is_delete = ev.get("type") == "DELETE"
    value = None if is_delete else _unb64(kv.get("value", ""))
    return WatchEvent(_unb64(kv["key"]).decode(), value, int(kv.get("mod_revision", 0)))


class EtcdClient:
    """Calls etcd's JSON API at ``endpoints`` (``HOST:PORT``), first answering one wins."""

    def __init__(
        self, endpoints: list[str], session: aiohttp.ClientSession, timeout_s: float = 2.0
    ) -> None:
        if not endpoints:
            raise EtcdError("no etcd endpoints configured")
        self._urls = [e if e.startswith("http") else f"http://{e}" for e in endpoints]
        self._session = session
        self._timeout_s = timeout_s
        self._live_url = self._urls[0]  # the endpoint that answered last (watches use it)

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last = "no endpoint tried"
        for url in self._urls:
            try:
                async with asyncio.timeout(self._timeout_s):
                    async with self._session.post(url + path, data=orjson.dumps(body)) as resp:
                        data = await resp.read()
                        status = resp.status
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = f"{url}: {type(exc).__name__}"
                continue
            if status != 200:
                raise EtcdError(f"etcd {path} answered {status}: {data[:200]!r}")
            self._live_url = url
            result: dict[str, Any] = orjson.loads(data)
            return result
        raise EtcdError(f"etcd unreachable ({last})")

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        """(store revision, {key: value}) of every key under ``prefix``."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        data = await self._call("/v3/kv/range", body)
        kvs = {
            _unb64(kv["key"]).decode(): _unb64(kv.get("value", "")) for kv in data.get("kvs", [])
        }
        return int(data["header"]["revision"]), kvs

    async def put(self, key: str, value: bytes, lease_id: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            body["lease"] = str(lease_id)
        await self._call("/v3/kv/put", body)

    async def get_one(self, key: str) -> tuple[int, bytes | None]:
        """(``mod_revision``, value) of ``key``; (0, None) when it does not exist."""
        data = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs", [])
        if not kvs:
            return 0, None
        return int(kvs[0].get("mod_revision", 0)), _unb64(kvs[0].get("value", ""))

    async def put_if_revision(
        self, key: str, value: bytes, mod_revision: int, lease_id: int | None = None
    ) -> tuple[bool, int]:
        """Put ``value`` only while ``key``'s ``mod_revision`` is ``mod_revision`` (0: the
        key does not exist), in one transaction. (True, the new revision) when written,
        (False, the store's revision) when the key had moved on. ``lease_id`` None keeps
        the key's lease (a new key gets none), 0 puts it without one."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id is None and mod_revision:
            put["ignore_lease"] = True
        elif lease_id:
            put["lease"] = str(lease_id)
        compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL"}
        compare["mod_revision"] = str(mod_revision)
        body = {"compare": [compare], "success": [{"request_put": put}]}
        data = await self._call("/v3/kv/txn", body)
        return bool(data.get("succeeded")), int(data["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def lease_grant(self, ttl_s: int) -> int:
        data = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if data.get("error"):
            raise EtcdError(f"lease grant failed: {data['error']}")
        return int(data["ID"])

    async def lease_keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL in seconds, 0 when it has expired."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(data.get("result", {}).get("TTL", 0))

    async def lease_revoke(self, lease_id: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease_id)})

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Events under ``prefix`` from ``start_revision`` on; ends (EtcdError) on a cut."""
        create = {
            "key": _b64(prefix),
            "range_end": _b64(prefix_end(prefix)),
            "start_revision": str(start_revision),
        }
        body = orjson.dumps({"create_request": create})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout_s)
        try:
            async with self._session.post(
                self._live_url + "/v3/watch", data=body, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise EtcdError(f"etcd watch answered {resp.status}")
                async for line in resp.content:
                    for ev in _watch_events(line):
                        yield ev
        except (aiohttp.ClientError, OSError) as exc:
            raise EtcdError(f"etcd watch cut: {type(exc).__name__}") from exc
        raise EtcdError("etcd watch stream ended")


def _watch_events(line: bytes) -> list[WatchEvent]:
    line = line.strip()
    if not line:
        return []
    msg = orjson.loads(line)
    if "error" in msg:
        raise EtcdError(f"etcd watch error: {msg['error']}")
    result = msg.get("result", {})
    if result.get("canceled"):
        raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
    return [_event(ev) for ev in result.get("events", [])]
