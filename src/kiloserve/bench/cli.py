"""``kiloserve bench``: drive an OpenAI-compatible endpoint and write a report.

kiloserve bench --url URL --model M --workload W [--rate R --burstiness B |
    --concurrency C] [--duration S | --num-requests N] --out DIR [--seed S]
    [--slo ttft=500ms,tpot=50ms] [--endpoint completions|chat]
    [--sweep concurrency=1,2,4,8 | rate=...] [--timeout S] [--api-key K]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiloserve.bench.client import (
    DEFAULT_TIMEOUT_S,
    ENDPOINTS,
    ClientOptions,
    ProgressCounts,
    run_bench,
)
from kiloserve.bench.sweep import parse_sweep, run_sweep, write_sweep
from kiloserve.errors import ConfigError
from kiloserve.results.metrics import Slo, parse_slo, summarize
from kiloserve.results.records import BenchResult
from kiloserve.results.report import write_report
from kiloserve.results.tables import fmt, prefix_cache_text
from kiloserve.workload import (
    ArrivalMode,
    ClosedLoop,
    OpenLoop,
    Workload,
    load_workload,
    parse_workload_spec,
)

__all__ = ["add_arguments", "run"]

DEFAULT_NUM_REQUESTS = 200
ProgressHook = Callable[[ProgressCounts], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    a("--model", required=True, help="model name sent in each request")
    a("--workload", required=True, help="azure-conv | azure-code | mooncake | synthetic:... | "
      "mix:... | sessions:... (see docs/workloads.md)")  # fmt: skip
    a("--out", required=True, type=Path, help="report folder")
    a("--rate", type=float, help="requests/s (open loop; 'inf' sends all at once); "
      "for traces: rescale the trace to this mean rate")  # fmt: skip
    a("--burstiness", type=float, default=1.0,
      help="gamma shape of gaps: 1 Poisson, <1 burstier, inf constant rate")  # fmt: skip
    a("--concurrency", type=int, help="closed loop: keep C requests in flight")
    a("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    a("--duration", type=float, help="seconds of arrivals (or of sending, closed loop)")
    a("--num-requests", type=int,
      help=f"number of requests (default {DEFAULT_NUM_REQUESTS} without --duration; "
           "a trace with --window replays the whole window)")  # fmt: skip
    a("--seed", type=int, default=0, help="workload seed (default 0)")
    a("--slo", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=2s")
    a("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    a("--sweep", help="concurrency=1,2,4,8 or rate=1,2,4: single-backend baseline sweep")
    a("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
      help=f"per-request timeout in s (default {DEFAULT_TIMEOUT_S:g})")  # fmt: skip
    a("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    a("--time-scale", type=float, default=1.0, help="traces: multiply timestamps")
    a("--window", help="traces: START:END seconds of the trace to replay")
    a("--traces-dir", type=Path, help="folder of the shipped traces")
    a("--no-plots", action="store_true", help="skip PNG plots")
    a("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    slo = parse_slo(args.slo) if args.slo else None
    options = ClientOptions(endpoint=args.endpoint, api_key=args.api_key, timeout_s=args.timeout)
    console = Console(stderr=True)
    command = _command_line(args)
    if args.sweep:
        return _run_sweep(args, options, slo, command, console)
    workload = _workload(args, args.seed, args.rate)
    arrival = _arrival(args, workload)
    with _progress(console, workload, args) as hook:
        result = asyncio.run(_bench(args, workload, arrival, options, hook, console))
    summary = summarize(result, slo, command=command)
    paths = write_report(args.out, result, summary, plot=not args.no_plots)
    Console().print(summary_table(summary))
    for key in ("client_warning", "dispatch_warning"):
        if summary.get(key):
            console.print(f"[yellow]warning:[/] {summary[key]}")
    console.print(f"report: {paths['summary.json'].parent}")
    return 0 if summary["requests_ok"] else 1


async def _bench(
    args: argparse.Namespace, workload: Workload, arrival: ArrivalMode, options: ClientOptions,
    hook: ProgressHook | None, console: Console,
) -> BenchResult:  # fmt: skip
    """``run_bench`` where the first Ctrl-C stops sending (in-flight requests finish and
    the report is written) and a second one aborts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        console.print("[yellow]stopping: waiting for requests in flight (Ctrl-C again aborts)")
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        return await run_bench(args.url, args.model, workload, arrival, options=options,
                               duration_s=args.duration, on_progress=hook, stop=stop)  # fmt: skip
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)


def _run_sweep(
    args: argparse.Namespace, options: ClientOptions, slo: Slo | None, command: list[str],
    console: Console,
) -> int:  # fmt: skip
    parameter, values = parse_sweep(args.sweep)
    if args.concurrency is not None or (args.rate is not None and parameter == "rate"):
        raise ConfigError(f"--sweep {parameter}=... replaces --{parameter}")

    def make_workload(index: int, value: float) -> Workload:
        return _workload(args, args.seed + index, value if parameter == "rate" else args.rate)

    def on_point(value: float) -> ProgressHook | None:
        console.print(f"sweep point {parameter}={value:g}")
        return None

    points = asyncio.run(
        run_sweep(args.url, args.model, make_workload, parameter, values, args.out,
                  options=options, duration_s=args.duration, slo=slo, command=command,
                  on_point=on_point, plot=not args.no_plots)
    )  # fmt: skip
    meta = {"url": args.url, "model": args.model, "workload": args.workload, "seed": args.seed,
            "command": command}  # fmt: skip
    data = write_sweep(args.out, parameter, points, meta, plot=not args.no_plots)
    print((Path(args.out) / "sweep.md").read_text())
    console.print(f"knee: {parameter}={data['knee']['value']:g}; report: {args.out}")
    return 0


def _workload(args: argparse.Namespace, seed: int, rate: float | None) -> Workload:
    num_requests = args.num_requests
    replays_window = args.window is not None and parse_workload_spec(args.workload).is_trace
    if num_requests is None and args.duration is None and not replays_window:
        num_requests = DEFAULT_NUM_REQUESTS
    return load_workload(
        args.workload, seed=seed, num_requests=num_requests, duration_s=args.duration,
        rate=rate, burstiness=args.burstiness, time_scale=args.time_scale,
        window=_window(args.window), traces_dir=args.traces_dir,
    )  # fmt: skip


def _arrival(args: argparse.Namespace, workload: Workload) -> ArrivalMode:
    if args.concurrency is not None:
        return ClosedLoop(args.concurrency)
    first = next(iter(workload), None)
    if first is None or first.arrival_s is None:
        raise ConfigError("give --rate R (open loop) or --concurrency C (closed loop)")
    return OpenLoop(args.max_concurrency)


def _check_args(args: argparse.Namespace) -> None:
    if args.rate is not None and args.concurrency is not None:
        raise ConfigError("--rate and --concurrency are exclusive (open vs closed loop)")
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigError("--concurrency must be >= 1")
    if args.rate is not None and math.isnan(args.rate):
        raise ConfigError("--rate must be a number")


def _window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    start, _, end = text.partition(":")
    try:
        return float(start or 0.0), float(end) if end else math.inf
    except ValueError:
        raise ConfigError(f"--window must be START:END seconds, got {text!r}") from None


def _command_line(args: argparse.Namespace) -> list[str]:
    """The command as typed (from ``sys.argv``) or rebuilt from ``args``; key redacted."""
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        return ["kiloserve", "bench", *_redacted(sys.argv[2:])]
    rebuilt: list[str] = []
    for key, value in vars(args).items():
        if value is None or value is False or key == "log_level":
            continue
        flag = "--" + key.replace("_", "-")
        rebuilt += [flag] if value is True else [flag, str(value)]
    return ["kiloserve", "bench", *_redacted(rebuilt)]


def _redacted(argv: list[str]) -> list[str]:
    """The command line without the API key (S6.1)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif arg == "--api-key":
            out.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(arg)
    return out


@contextmanager
def _progress(
    console: Console, workload: Workload, args: argparse.Namespace
) -> Iterator[ProgressHook | None]:
    if args.no_progress:
        yield None
        return
    total = workload.num_requests
    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=total if total else args.duration)

        def hook(c: ProgressCounts) -> None:
            done = c.num_done if total else min(c.elapsed_s, args.duration or 0.0)
            text = (f"sent {c.num_sent} done {c.num_done} failed {c.num_failed} "
                    f"in flight {c.num_in_flight}")  # fmt: skip
            progress.update(task, completed=done, description=text)

        yield hook


def summary_table(summary: dict[str, Any]) -> Table:
    """A rich table of the headline numbers."""
    table = Table(title=f"kiloserve bench: {summary['workload'].get('name')}")
    for col in ("metric", "mean", "p50", "p90", "p95", "p99"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for name, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"), ("ITL ms", "itl_ms"),
                      ("E2E ms", "e2e_ms")):  # fmt: skip
        s = summary[key]
        table.add_row(name, *(fmt(s[k]) for k in ("mean", "p50", "p90", "p95", "p99")))
    table.caption = (
        f"ok {summary['requests_ok']}  failed {summary['requests_failed']}  "
        f"timeouts {summary['timeouts']}  {fmt(summary['request_throughput'], 2)} req/s  "
        f"{fmt(summary['output_token_throughput'])} out tok/s"
        + (f"  goodput {fmt(summary['goodput'], 2)} req/s" if "goodput" in summary else "")
    )
    cache = prefix_cache_text(summary)
    if cache is not None:
        table.caption += f"\nprefix-cache hit rate {cache}"
    return table
