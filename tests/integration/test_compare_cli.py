"""``kiloserve compare`` on a real local twin cluster: ``--traces-dir`` and ``--timeout``.

One of the two twins stalls every stream after two tokens (its ``faults`` in the
cluster YAML), so with round robin some requests time out at the client: the report
must count them (failed, timeouts, and the E2E percentiles), not drop them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiloserve.bench import compare
from kiloserve.bench.client import ClientOptions
from kiloserve.cli import main
from kiloserve.results.report import load_records, load_summary

CLUSTER_YAML = """\
name: stall
gateway:
  port: 0
backends:
  - name: good
    gpu: H100
    model: llama-3.1-8b
  - name: stuck
    gpu: H100
    model: llama-3.1-8b
    faults:
      stall_after_tokens: 2
"""


def test_compare_timeout_defaults_to_the_library_default() -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["-c", "x.yaml", "--workload", "azure-conv", "--out", "o"])
    assert args.timeout == ClientOptions().timeout_s == 600.0
    assert args.traces_dir is None


def test_compare_reads_traces_dir_and_counts_timed_out_requests(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    rows = "".join(f"{0.1 * i:.1f},{40 + i},17\n" for i in range(8))
    (traces / "azure_code_2023.csv").write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows
    )
    config = tmp_path / "cluster.yaml"
    config.write_text(CLUSTER_YAML)
    out = tmp_path / "out"
    code = main([
        "compare", "-c", str(config), "--policies", "round_robin", "--workload", "azure-code",
        "--traces-dir", str(traces), "--num-requests", "8", "--timeout", "2",
        "--out", str(out), "--no-plots",
    ])  # fmt: skip
    assert code == 0  # some requests succeeded
    records = load_records(out / "round_robin")
    assert len(records) == 8 and {r.max_tokens for r in records} == {17}  # our trace
    summary = load_summary(out / "round_robin")
    timed_out = [r for r in records if r.is_timeout]
    assert timed_out and {r.backend for r in timed_out} == {"stuck"}
    assert summary["timeouts"] == summary["requests_failed"] == len(timed_out)
    assert summary["requests_ok"] + summary["requests_failed"] == 8
    assert summary["e2e_ms"]["p99"] >= 2000.0  # the waits are in the percentiles
    table = (out / "comparison.md").read_text()
    assert f"| timeouts (in failed) | {len(timed_out)} |" in table
