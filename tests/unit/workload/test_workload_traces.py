"""Trace parsers on the shipped files and trace replay options."""

from __future__ import annotations

import fnmatch
import gzip
import lzma
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kiloserve.errors import ConfigError
from kiloserve.tokens import block_hashes, count_tokens, tokenize
from kiloserve.workload import find_traces_dir, load_workload, read_trace
from kiloserve.workload.traces import PACKAGED_TRACES_DIR, TRACE_FILES

ROOT = Path(__file__).resolve().parents[3]
TRACES = PACKAGED_TRACES_DIR  # the copies shipped with the package (xz)
# The uncompressed originals, where this checkout sits next to ../shared (not in a clone).
SHARED_TRACES = ROOT.parent / "shared" / "data" / "traces"


def test_default_trace_dir_is_the_packaged_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILOSERVE_TRACES", raising=False)
    assert find_traces_dir() == TRACES
    assert TRACES.parts[-3:] == ("kiloserve", "workload", "data")
    assert sorted(p.name for p in TRACES.glob("*.xz")) == sorted(
        f + ".xz" for f in TRACE_FILES.values()
    )
    monkeypatch.setenv("KILOSERVE_TRACES", "/nonexistent/traces")
    with pytest.raises(ConfigError, match="--traces-dir"):
        find_traces_dir()


def test_packaged_traces_are_package_data_of_reasonable_size() -> None:
    """pyproject's package-data globs take every packaged trace and its licence file."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["kiloserve"]
    package = ROOT / "src" / "kiloserve"
    for path in (package / "workload" / "data").iterdir():
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel
    assert (TRACES / "README.md").read_text().count("Apache-2.0") >= 1
    assert sum(p.stat().st_size for p in TRACES.glob("*.xz")) < 600_000


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason=f"no originals at {SHARED_TRACES}")
@pytest.mark.parametrize("name", sorted(TRACE_FILES))
def test_packaged_traces_load_identically_to_the_originals(name: str) -> None:
    assert read_trace(name, TRACES) == read_trace(name, SHARED_TRACES)
    packaged = load_workload(name, seed=0, num_requests=50, traces_dir=TRACES).take(50)
    shared = load_workload(name, seed=0, num_requests=50, traces_dir=SHARED_TRACES).take(50)
    assert packaged == shared


def test_trace_files_may_be_plain_xz_or_gz(tmp_path: Path) -> None:
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,3\n1.5,20,4\n"
    plain, xz, gz = (tmp_path / d for d in ("plain", "xz", "gz"))
    for folder in (plain, xz, gz):
        folder.mkdir()
    (plain / "azure_code_2023.csv").write_text(text)
    (xz / "azure_code_2023.csv.xz").write_bytes(lzma.compress(text.encode()))
    (gz / "azure_code_2023.csv.gz").write_bytes(gzip.compress(text.encode()))
    rows = [read_trace("azure-code", folder) for folder in (plain, xz, gz)]
    assert rows[0] == rows[1] == rows[2] and [r.input_tokens for r in rows[0]] == [10, 20]
    (xz / "azure_code_2023.csv.xz").write_bytes(b"not xz")
    with pytest.raises(ConfigError, match="cannot decompress"):
        read_trace("azure-code", xz)
    with pytest.raises(ConfigError, match=r"trace file missing .*mooncake_conversation\.jsonl\.xz"):
        read_trace("mooncake", plain)


def test_a_trace_is_parsed_once_per_file_version(tmp_path: Path) -> None:
    """read_trace caches the parsed rows by (file, mtime, size): a simulation reads its
    trace twice. Each caller gets a list of its own; an edited file is parsed again."""
    path = tmp_path / "azure_code_2023.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,3\n")
    first, second = read_trace("azure-code", tmp_path), read_trace("azure-code", tmp_path)
    assert first == second and first is not second
    assert first[0] is second[0]  # the same parsed row: not parsed again
    first.clear()
    assert read_trace("azure-code", tmp_path) == second
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,70,3\n1.0,8,2\n")
    assert [r.input_tokens for r in read_trace("azure-code", tmp_path)] == [70, 8]


@pytest.mark.parametrize(
    ("name", "num_rows", "mean_in", "mean_out"),
    [
        ("azure-conv", 19_366, 1155, 211),
        ("azure-code", 8_819, 2048, 28),
        ("mooncake", 12_031, 12_035, 343),
    ],
)
def test_parsers_match_readme_statistics(
    name: str, num_rows: int, mean_in: int, mean_out: int
) -> None:
    rows = read_trace(name, TRACES)
    assert len(rows) == num_rows
    assert np.mean([r.input_tokens for r in rows]) == pytest.approx(mean_in, rel=0.01)
    assert np.mean([r.output_tokens for r in rows]) == pytest.approx(mean_out, rel=0.01)
    times = [r.arrival_s for r in rows]
    assert times == sorted(times) and 55 * 60 < times[-1] < 60 * 60


def test_mooncake_hash_ids_become_identical_prompt_prefixes() -> None:
    specs = load_workload("mooncake", seed=0, num_requests=5, traces_dir=TRACES).take(5)
    rows = read_trace("mooncake", TRACES)[:5]
    for spec, row in zip(specs, rows, strict=True):
        assert spec.input_tokens == row.input_tokens == count_tokens(spec.prompt)
    # rows 0 and 1 share hash id 0 only (first 512-token block), then differ
    h0, h1 = (block_hashes(tokenize(s.prompt)) for s in specs[:2])
    assert h0[:32] == h1[:32] and h0[32] != h1[32]
    assert specs[0].prompt[:2000] == specs[1].prompt[:2000]


def test_mooncake_prefixes_do_not_depend_on_seed() -> None:
    a = load_workload("mooncake", seed=0, num_requests=3, traces_dir=TRACES).take(3)
    b = load_workload("mooncake", seed=9, num_requests=3, traces_dir=TRACES).take(3)
    assert [s.prompt for s in a] == [s.prompt for s in b]


def test_trace_replay_window_scale_and_limits() -> None:
    full = load_workload("azure-conv", seed=0, traces_dir=TRACES, with_prompts=False)
    assert full.num_requests == 19_366
    window = load_workload("azure-conv", seed=0, window=(60.0, 120.0), time_scale=0.5,
                           traces_dir=TRACES, with_prompts=False)  # fmt: skip
    times = [s.arrival_s or 0.0 for s in window]
    assert times[0] == 0.0 and max(times) < 30.0
    rated = load_workload("azure-code", seed=0, rate=50.0, traces_dir=TRACES,
                          with_prompts=False)  # fmt: skip
    assert list(rated)[-1].arrival_s == pytest.approx((8_819 - 1) / 50.0)  # mean rate 50/s
    cut = load_workload("azure-code", seed=0, rate=50.0, duration_s=10.0, traces_dir=TRACES,
                        with_prompts=False)  # fmt: skip
    cut_times = [s.arrival_s or 0.0 for s in cut]
    assert cut.num_requests == len(cut_times) > 10 and max(cut_times) < 10.0
    first = load_workload("azure-code", seed=0, num_requests=3, traces_dir=TRACES)
    assert [s.request_id for s in first] == ["azure-code-000000", "azure-code-000001",
                                            "azure-code-000002"]  # fmt: skip


def test_repeat_replays_passes_back_to_back() -> None:
    one = load_workload("azure-code", seed=0, rate=50.0, traces_dir=TRACES, with_prompts=False)
    three = load_workload("azure-code:repeat=3", seed=0, rate=50.0, traces_dir=TRACES,
                          with_prompts=False)  # fmt: skip
    n = 8_819
    assert three.num_requests == 3 * n and three.params["repeat"] == 3
    specs = list(three)
    assert len(specs) == 3 * n
    base = list(one)
    assert specs[:n] == base  # pass 0 is the plain replay
    period = n / 50.0  # span (n-1)/50 plus one mean gap 1/50
    for k in (1, 2):
        for a, b in zip(base[:50], specs[k * n : k * n + 50], strict=True):
            assert b.arrival_s == pytest.approx((a.arrival_s or 0.0) + k * period)
            assert b.request_id == a.request_id.replace("azure-code-", f"azure-code-r{k}-")
            assert (b.input_tokens, b.output_tokens) == (a.input_tokens, a.output_tokens)
    times = [s.arrival_s or 0.0 for s in specs]
    assert times == sorted(times)
    assert len({s.request_id for s in specs}) == 3 * n
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(1 / 50.0, rel=1e-6)  # the rate holds over seams


def test_repeat_inf_runs_until_duration_or_count() -> None:
    day = load_workload("azure-conv:repeat=inf", seed=0, rate=200.0, duration_s=400.0,
                        traces_dir=TRACES, with_prompts=False)  # fmt: skip
    times = [s.arrival_s or 0.0 for s in day]
    assert day.num_requests == len(times) and max(times) < 400.0
    assert len(times) == pytest.approx(400.0 * 200.0, rel=0.01)  # ~4 passes of 19,366
    counted = load_workload("azure-conv:repeat=inf", seed=0, num_requests=50_000,
                            traces_dir=TRACES, with_prompts=False)  # fmt: skip
    assert counted.num_requests == 50_000 == sum(1 for _ in counted)
    with pytest.raises(ConfigError, match="repeat=inf needs"):
        load_workload("azure-conv:repeat=inf", traces_dir=TRACES)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("azure-conv:repeat=0", "repeat"),
        ("azure-conv:repeat=x", "repeat"),
        ("azure-conv:loop=1", "unknown option 'loop'"),
        ("azure-conv:", "takes options"),
    ],
)
def test_repeat_bad_options(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_workload(spec, traces_dir=TRACES, num_requests=10)


def test_repeated_passes_get_their_own_text() -> None:
    n = 12_031
    moon = load_workload("mooncake:repeat=2", seed=0, traces_dir=TRACES)
    specs = moon.take(n + 2)
    first, again = specs[:2], specs[n:]
    assert again[0].request_id == "mooncake-r1-000000"
    assert again[0].prefix_group == "r1-block-0" and first[0].prefix_group == "block-0"
    for a, b in zip(first, again, strict=True):
        assert count_tokens(b.prompt) == b.input_tokens == a.input_tokens
        assert block_hashes(tokenize(a.prompt))[0] != block_hashes(tokenize(b.prompt))[0]
    # within pass 1, rows 0 and 1 still share their first 512-token block
    h0, h1 = (block_hashes(tokenize(s.prompt)) for s in again)
    assert h0[:32] == h1[:32] and h0[32] != h1[32]
