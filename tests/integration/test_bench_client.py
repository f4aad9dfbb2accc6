"""End-to-end bench against a small fake OpenAI SSE server on 127.0.0.1.

The fake server streams ``max_tokens`` chunks (plus a usage chunk and ``[DONE]``) and
tags each response with ``x-kiloserve-backend`` (b0 fast, b1 slower). Model names
switch behaviour: ``fail`` answers 503, ``hang`` never finishes. It runs in its own
thread and event loop so the CLI (which calls ``asyncio.run``) can drive it too.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from kiloserve.bench.client import ClientOptions, run_bench
from kiloserve.cli import main
from kiloserve.results import plots
from kiloserve.results.metrics import parse_slo, summarize
from kiloserve.results.report import load_records, load_summary, write_comparison, write_report
from kiloserve.tokens import count_tokens
from kiloserve.workload import ClosedLoop, OpenLoop, load_workload

SPEC = "synthetic:input=uniform(20,60),output=uniform(2,8)"


class FakeServer:
    """aiohttp OpenAI-like streaming server in a background thread."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.peers: set[object] = set()
        self.stalled = False
        self._counter = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        if body["model"] == "fail":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        backend = f"b{next(self._counter) % 2}"
        is_chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-kiloserve-backend": backend})  # fmt: skip
        await resp.prepare(request)
        if body["model"] == "hang":
            await asyncio.sleep(10)
        if body["model"] == "stall-once" and not self.stalled:  # one token, then nothing
            self.stalled = True
            choice = {"delta": {"content": " w"}} if is_chat else {"text": " w"}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            await asyncio.sleep(10)
        gap_s = 0.002 if backend == "b0" else 0.01
        for i in range(body["max_tokens"]):
            await asyncio.sleep(gap_s)
            choice = {"delta": {"content": f" w{i}"}} if is_chat else {"text": f" w{i}"}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        return resp


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def _bench(url: str, model: str = "m", **kwargs: Any) -> Any:
    workload = load_workload(SPEC, seed=1, num_requests=kwargs.pop("num_requests", 20),
                             rate=kwargs.pop("rate", None))  # fmt: skip
    arrival = kwargs.pop("arrival", ClosedLoop(4))
    return await run_bench(url, model, workload, arrival, **kwargs)


def test_closed_loop_records_and_request_bodies(server: FakeServer) -> None:
    result = asyncio.run(_bench(server.url, options=ClientOptions(api_key="sk-test")))
    assert len(result.records) == 20 and all(r.is_ok for r in result.records)
    for r in result.records:
        assert r.output_tokens == r.max_tokens
        assert r.ttft_s is not None and r.ttft_s > 0
        assert len(r.itl_s) == r.num_chunks - 1
        assert r.backend in {"b0", "b1"}
    body = server.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert {count_tokens(b["prompt"]) for b in server.bodies} <= set(range(20, 61))
    assert server.auth[0] == "Bearer sk-test"
    assert result.client.max_in_flight <= 4
    assert len(server.peers) <= 4  # pooled keep-alive connections, one per slot


def test_open_loop_follows_arrival_times(server: FakeServer) -> None:
    result = asyncio.run(_bench(server.url, rate=50.0, num_requests=25, arrival=OpenLoop()))
    starts = sorted(r.start_s for r in result.records)
    scheduled = sorted(r.scheduled_s or 0.0 for r in result.records)
    for start, sched in zip(starts, scheduled, strict=True):
        assert start >= sched - 0.001 and start - sched < 0.1
    assert result.duration_s >= scheduled[-1]


def test_summary_groups_backends_and_goodput(server: FakeServer) -> None:
    result = asyncio.run(_bench(server.url, num_requests=30))
    summary = summarize(result, parse_slo("tpot=6ms"))
    per_backend = summary["per_backend"]
    assert set(per_backend) == {"b0", "b1"}
    assert per_backend["b1"]["tpot_ms"]["p50"] > per_backend["b0"]["tpot_ms"]["p50"]
    # only b0's requests (2 ms gaps) meet a 6 ms TPOT SLO
    good = summary["goodput"] * summary["duration_s"]
    assert 8 <= round(good) <= 22
    assert summary["p95_std_across_backends_ms"] > 0


def test_errors_and_timeouts_are_counted(server: FakeServer) -> None:
    failed = asyncio.run(_bench(server.url, model="fail", num_requests=5))
    assert all(not r.is_ok and r.status == 503 for r in failed.records)
    assert "overloaded" in (failed.records[0].error or "")
    hung = asyncio.run(_bench(server.url, model="hang", num_requests=3,
                              options=ClientOptions(timeout_s=0.3)))  # fmt: skip
    assert all(r.is_timeout and not r.is_ok for r in hung.records)
    summary = summarize(hung)
    assert summary["timeouts"] == 3 and summary["error_rate"] == 1.0


def test_a_timed_out_request_counts_in_failures_and_percentiles(
    server: FakeServer, tmp_path: Path
) -> None:
    """One request of 8 stalls after its first token: it fails, as a timeout, and enters
    the E2E percentiles at its wait (TTFT at its real first token); nothing is dropped."""
    options = ClientOptions(timeout_s=0.5)
    result = asyncio.run(_bench(server.url, model="stall-once", num_requests=8,
                                arrival=ClosedLoop(8), options=options))  # fmt: skip
    summary = summarize(result)
    assert (summary["requests_ok"], summary["requests_failed"], summary["timeouts"]) == (7, 1, 1)
    (late,) = [r for r in result.records if r.is_timeout]
    assert late.ttft_s is not None and late.ttft_s < 0.4 and late.e2e_s is not None
    assert summary["e2e_ms"]["p99"] > 400.0  # the 0.5 s wait is in the percentiles
    assert summary["ttft_ms"]["p99"] < 400.0  # its first token did come in time
    assert summary["per_backend"][late.backend]["e2e_ms"]["p99"] > 400.0
    # no first token at all: TTFT and E2E both count the wait until the timeout
    hung = summarize(asyncio.run(_bench(server.url, model="hang", num_requests=2,
                                        options=ClientOptions(timeout_s=0.3))))  # fmt: skip
    assert hung["ttft_ms"]["p50"] >= 300.0 and hung["e2e_ms"]["p50"] >= 300.0
    assert hung["tpot_ms"]["p50"] is None and hung["itl_ms"]["p50"] is None
    write_comparison(tmp_path, {"stall": summary, "hang": hung}, title="t", plot=False)
    table = (tmp_path / "comparison.md").read_text()
    assert "| requests failed | 1 | 2 (2.00x) |" in table
    assert "| timeouts (in failed) | 1 | 2 (2.00x) |" in table


def test_chat_endpoint(server: FakeServer) -> None:
    result = asyncio.run(_bench(server.url, options=ClientOptions(endpoint="chat"),
                                num_requests=4))  # fmt: skip
    assert all(r.is_ok and r.output_tokens == r.max_tokens for r in result.records)
    assert "messages" in server.bodies[0] and "prompt" not in server.bodies[0]


def test_report_files_and_comparison(server: FakeServer, tmp_path: Path) -> None:
    result = asyncio.run(_bench(server.url))
    summary = summarize(result, parse_slo("ttft=1s"), command=["kiloserve", "bench"])
    paths = write_report(tmp_path / "run", result, summary)
    assert {"summary.json", "requests.jsonl", "summary.md"} <= set(paths)
    assert {"ttft_cdf.png", "e2e_cdf.png", "backend_p95.png"} <= set(paths)
    loaded = load_summary(tmp_path / "run")
    assert loaded["requests_ok"] == 20 and loaded["config_hash"] == summary["config_hash"]
    assert len(load_records(tmp_path / "run")) == 20
    again = asyncio.run(_bench(server.url))
    assert again.workload_digest == result.workload_digest  # same seed: same sequence
    other = summarize(again)
    cmp_paths = write_comparison(
        tmp_path / "cmp",
        {"first": summary, "second": other},
        records={"first": result.records, "second": again.records},
    )
    text = cmp_paths["comparison.md"].read_text()
    assert "| TTFT P95 (ms) |" in text and "x)" in text and "identical" in text
    assert "ttft_cdf.png" in cmp_paths


def test_cli_writes_all_report_files(server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "report"
    code = main(["bench", "--url", server.url, "--model", "m", "--workload", SPEC,
                 "--concurrency", "4", "--num-requests", "12", "--out", str(out),
                 "--slo", "ttft=500ms,tpot=50ms", "--seed", "5", "--api-key", "sk-secret",
                 "--no-progress"])  # fmt: skip
    assert code == 0
    summary = orjson.loads((out / "summary.json").read_bytes())
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[key]) >= {"mean", "p50", "p90", "p95", "p99"}
    for key in ("requests_ok", "requests_failed", "request_throughput",
                "output_token_throughput", "goodput", "per_backend", "schema_version"):  # fmt: skip
        assert key in summary
    assert summary["requests_ok"] == 12 and summary["seed"] == 5
    assert "sk-secret" not in (out / "summary.json").read_text()
    for name in ("requests.jsonl", "summary.md", "ttft_cdf.png", "e2e_cdf.png"):
        assert (out / name).is_file()


def test_cli_sweep_finds_knee(server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code = main(["bench", "--url", server.url, "--model", "m", "--workload", SPEC,
                 "--sweep", "concurrency=1,2,4", "--num-requests", "8", "--out", str(out),
                 "--no-progress", "--no-plots"])  # fmt: skip
    assert code == 0
    sweep = orjson.loads((out / "sweep.json").read_bytes())
    assert [p["value"] for p in sweep["points"]] == [1, 2, 4]
    assert sweep["knee"]["value"] in (1, 2, 4)
    assert (out / "concurrency_2" / "summary.json").is_file()
    assert (out / "sweep.md").is_file() and not (out / "sweep.png").exists()
    rows = sweep["points"]
    assert plots.plot_sweep(tmp_path / "s.png", rows, parameter="concurrency", knee=None)


def test_cli_rejects_bad_arguments(server: FakeServer, tmp_path: Path) -> None:
    base = ["bench", "--url", server.url, "--model", "m", "--out", str(tmp_path)]
    assert main([*base, "--workload", "nonsense"]) == 2
    assert main([*base, "--workload", SPEC]) == 2  # neither rate nor concurrency
    assert main([*base, "--workload", SPEC, "--rate", "1", "--concurrency", "2"]) == 2


def test_cli_replays_a_trace_window(server: FakeServer, tmp_path: Path) -> None:
    traces = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
    if not traces.is_dir():
        pytest.skip("no shipped traces")
    out = tmp_path / "trace"
    code = main(["bench", "--url", server.url + "/v1", "--model", "m", "--workload",
                 "azure-code", "--window", "0:3", "--time-scale", "0.5", "--out", str(out),
                 "--traces-dir", str(traces), "--no-progress", "--no-plots"])  # fmt: skip
    assert code == 0
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["requests_ok"] == 12  # the whole window, not the 200 default
    assert summary["workload"]["time_scale"] == 0.5
    assert summary["config"]["arrival"]["mode"] == "open"
    assert summary["dispatch_delay_ms"]["p50"] < 50.0
    assert not (out / "ttft_cdf.png").exists()


def test_stop_event_ends_an_unbounded_run(server: FakeServer) -> None:
    async def scenario() -> Any:
        stop = asyncio.Event()
        workload = load_workload(SPEC, seed=0, duration_s=60.0)  # closed loop, unbounded
        asyncio.get_running_loop().call_later(0.4, stop.set)
        return await run_bench(server.url, "m", workload, ClosedLoop(3), duration_s=60.0,
                               stop=stop)  # fmt: skip

    t0 = time.perf_counter()
    result = asyncio.run(scenario())
    assert time.perf_counter() - t0 < 5.0
    assert result.config["stopped_early"] is True
    assert result.records and all(r.is_ok for r in result.records)  # in-flight ones finished


def test_ctrl_c_writes_a_partial_report(server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "partial"
    cmd = [sys.executable, "-m", "kiloserve", "bench", "--url", server.url, "--model", "m",
           "--workload", SPEC, "--concurrency", "2", "--duration", "60", "--out", str(out),
           "--no-progress", "--no-plots"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15.0
        while len(server.bodies) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["config"]["stopped_early"] is True and summary["requests_ok"] >= 1
    assert "stopped early" in (out / "summary.md").read_text()


def test_report_without_matplotlib_says_so_and_skips_plots(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    result = asyncio.run(_bench(server.url, num_requests=4))
    monkeypatch.setattr(plots, "is_available", lambda: False)
    with caplog.at_level("WARNING"):
        paths = write_report(tmp_path, result, summarize(result))
    assert set(paths) == {"summary.json", "requests.jsonl", "summary.md"}
    assert "matplotlib is not installed" in caplog.text
