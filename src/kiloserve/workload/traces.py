"""Replay of the shipped production traces (token counts only, no text).

* Azure LLM inference trace 2023 (CSV: ``arrived_at`` seconds, ``num_prefill_tokens``,
  ``num_decode_tokens``): ``azure-conv`` and ``azure-code``. Prompts are unique text.
* Mooncake conversation trace (JSONL: ``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``: one id per 512-token block). Block ``h`` always
  renders to the same 512 words, so equal ``hash_ids`` prefixes give byte-identical
  prompt prefixes and the engine's prefix cache really hits.

``repeat`` replays the selection back to back: pass ``k`` (from 0) shifts every arrival
by ``k`` periods (the selection's span plus one mean gap, so the rate holds across the
seam), names its requests ``NAME-rK-INDEX`` and gives them their own text (unique text
and Mooncake blocks are new per pass: a pass is more traffic of the same shape, not a
cache-warm rerun). Pass 0 is the plain replay, request for request.

The trace folder is ``traces_dir`` if given, else ``$KILOSERVE_TRACES``, else the
copies shipped with the package (``kiloserve/workload/data``, xz-compressed, licences
and attribution in its ``README.md``). In any folder a file may be plain or compressed
(``NAME``, ``NAME.xz`` or ``NAME.gz``; the first found is read).
"""

from __future__ import annotations

import csv
import gzip
import importlib.resources
import io
import lzma
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from kiloserve.errors import ConfigError
from kiloserve.workload.prompts import (
    BLOCK_TOKENS,
    NS_MOONCAKE,
    NS_UNIQUE,
    PromptBuilder,
    Segment,
    split_tokens,
)
from kiloserve.workload.request import RequestSpec

__all__ = [
    "PACKAGED_TRACES_DIR",
    "TRACE_FILES",
    "TraceRow",
    "find_traces_dir",
    "pass_request_id",
    "read_azure_csv",
    "read_mooncake_jsonl",
    "read_trace",
    "trace_requests",
]

TRACE_FILES = {
    "azure-conv": "azure_conv_2023.csv",
    "azure-code": "azure_code_2023.csv",
    "mooncake": "mooncake_conversation.jsonl",
}
ENV_VAR = "KILOSERVE_TRACES"
# Not from __file__: the compiled build loads this module from elsewhere (sim/build.py).
PACKAGED_TRACES_DIR = Path(str(importlib.resources.files("kiloserve.workload"))) / "data"
_SUFFIXES = ("", ".xz", ".gz")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace request: arrival in seconds from the trace start."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


# Parsed traces by (file, mtime, size): a simulation reads its trace twice (the workload,
# then the Mooncake prompts' hash ids), and a sweep once per run; parsing the Mooncake
# trace costs 60-90 ms (docs/simulator.md, "Fifth round"). An edited file has a new key.
_ROWS: dict[tuple[str, int, int], list[TraceRow]] = {}
_MAX_CACHED = 4


def find_traces_dir(traces_dir: str | Path | None = None) -> Path:
    """The folder holding the shipped traces (see module docstring)."""
    if traces_dir is not None:
        candidates = [Path(traces_dir)]
    elif os.environ.get(ENV_VAR):
        candidates = [Path(os.environ[ENV_VAR])]
    else:
        candidates = [PACKAGED_TRACES_DIR]
    for path in candidates:
        if path.is_dir():
            return path
    raise ConfigError(
        f"trace folder not found (tried {', '.join(map(str, candidates))}); "
        f"pass --traces-dir or set ${ENV_VAR}"
    )


def read_trace(name: str, traces_dir: str | Path | None = None) -> list[TraceRow]:
    """Rows of a shipped trace by name (``azure-conv``, ``azure-code``, ``mooncake``)."""
    if name not in TRACE_FILES:
        raise ConfigError(f"unknown trace {name!r}; valid: {', '.join(TRACE_FILES)}")
    folder = find_traces_dir(traces_dir)
    file_name = TRACE_FILES[name]
    for suffix in _SUFFIXES:
        path = folder / (file_name + suffix)
        if path.is_file():
            break
    else:
        tried = ", ".join(file_name + s for s in _SUFFIXES)
        raise ConfigError(f"trace file missing in {folder} (tried {tried})")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    rows = _ROWS.get(key)
    if rows is None:
        is_jsonl = file_name.endswith(".jsonl")
        rows = read_mooncake_jsonl(path) if is_jsonl else read_azure_csv(path)
        if len(_ROWS) >= _MAX_CACHED:
            del _ROWS[next(iter(_ROWS))]
        _ROWS[key] = rows
    return list(rows)  # the rows are frozen; the list is the caller's own


def _read_bytes(path: Path) -> bytes:
    """The bytes of ``path``, decompressed when it ends in .xz or .gz (a few MB at most)."""
    data = path.read_bytes()
    try:
        if path.suffix == ".xz":
            return lzma.decompress(data)
        if path.suffix == ".gz":
            return gzip.decompress(data)
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError) as exc:
        raise ConfigError(f"{path}: cannot decompress: {exc}") from exc
    return data


def read_azure_csv(path: Path) -> list[TraceRow]:
    """Parse an Azure 2023 trace CSV (splitwise/vidur processed columns; .xz/.gz too)."""
    need = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
    with io.StringIO(_read_bytes(path).decode(), newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{path}: missing columns {missing}; expected {list(need)}")
        try:
            return [TraceRow(float(r[need[0]]), int(r[need[1]]), int(r[need[2]])) for r in reader]
        except ValueError as exc:
            raise ConfigError(f"{path}: bad value: {exc}") from exc


def read_mooncake_jsonl(path: Path) -> list[TraceRow]:
    """Parse a Mooncake trace (``timestamp`` in ms; .xz/.gz too)."""
    rows: list[TraceRow] = []
    for line_no, line in enumerate(_read_bytes(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = orjson.loads(line)
            rows.append(
                TraceRow(
                    float(d["timestamp"]) / 1000.0,
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d.get("hash_ids", ())),
                )
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}:{line_no}: bad record: {exc}") from exc
    return rows


def trace_requests(
    name: str,
    rows: Sequence[TraceRow],
    indices: Sequence[int],
    arrivals: Sequence[float | None],
    *,
    seed: int,
    builder: PromptBuilder,
    with_prompts: bool = True,
    repeat: float = 1,
    period_s: float = 0.0,
) -> Iterator[RequestSpec]:
    """Requests for the selected ``indices`` of ``rows`` with the given arrival times,
    ``repeat`` times (``math.inf``: endless), pass ``k`` shifted by ``k * period_s``."""
    k = 0
    while k < repeat:
        base_s = k * period_s
        for index, arrival_s in zip(indices, arrivals, strict=True):
            row = rows[index]
            prompt = builder.render(_segments(row, seed, index, k)) if with_prompts else ""
            yield RequestSpec(
                request_id=pass_request_id(name, index, k),
                arrival_s=None if arrival_s is None else arrival_s + base_s,
                input_tokens=max(1, row.input_tokens),  # what the segments add up to
                output_tokens=max(1, row.output_tokens),
                prompt=prompt,
                prefix_group=_prefix_group(row, k),
            )
        k += 1


def pass_request_id(name: str, index: int, k: int) -> str:
    """``NAME-INDEX`` on the first pass, ``NAME-rK-INDEX`` on pass ``k`` > 0."""
    digits = str(index).zfill(6)  # = f"{index:06d}" (index >= 0), without str.format
    return f"{name}-{digits}" if k == 0 else f"{name}-r{k}-{digits}"


def _prefix_group(row: TraceRow, k: int) -> str | None:
    if not row.hash_ids:
        return None
    return f"block-{row.hash_ids[0]}" if k == 0 else f"r{k}-block-{row.hash_ids[0]}"


def _segments(row: TraceRow, seed: int, index: int, k: int = 0) -> list[Segment]:
    input_tokens = max(1, row.input_tokens)
    # Pass k > 0 keys its text by k too (longer keys: never equal to a pass-0 key).
    unique: tuple[int, ...] = (NS_UNIQUE, seed, index) if k == 0 else (NS_UNIQUE, seed, index, k)
    if not row.hash_ids:
        return split_tokens(unique, input_tokens)
    segments: list[Segment] = []
    left = input_tokens
    for h in row.hash_ids:
        if left <= 0:
            break
        n = min(BLOCK_TOKENS, left)
        segments.append(((NS_MOONCAKE, h) if k == 0 else (NS_MOONCAKE, h, k), n))
        left -= n
    if left > 0:  # longer than its blocks: the rest is unique text
        segments += split_tokens(unique, left)
    return segments
