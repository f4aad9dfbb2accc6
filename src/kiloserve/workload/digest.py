"""A digest of the sent workload: equal digests mean identical request sequences."""

from __future__ import annotations

import hashlib
import zlib

from kiloserve.workload.request import RequestSpec

__all__ = ["DIGEST_BATCH", "WorkloadDigest"]

DIGEST_BATCH = 512


class WorkloadDigest:
    """SHA-256 over the sent sequence (ids, arrival times, lengths, prompt CRCs).

    Two runs with equal digests sent identical requests in the same order.
    """

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._lines: list[str] = []  # hashed in batches: the same bytes, fewer calls

    def add(self, spec: RequestSpec) -> None:
        prompt = spec.prompt
        crc = zlib.crc32(prompt.encode()) if prompt else 0  # crc32(b"") == 0
        # plain str/int fields only: mypyc builds such f-strings without str.format
        arrival = repr(spec.arrival_s)
        self._lines.append(
            f"{spec.request_id}|{arrival}|{spec.input_tokens}|{spec.output_tokens}|{crc}\n"
        )
        if len(self._lines) >= DIGEST_BATCH:
            self._flush()

    def _flush(self) -> None:
        self._hash.update("".join(self._lines).encode())
        self._lines.clear()

    def hexdigest(self) -> str:
        self._flush()
        return self._hash.hexdigest()
