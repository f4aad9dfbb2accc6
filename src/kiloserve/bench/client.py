"""Streaming OpenAI-compatible benchmark client (``run_bench``).

One pooled ``aiohttp.ClientSession`` (connector limit = concurrency), one task per
request, timestamps (``time.perf_counter``) taken when each read returns data. A read
can hold several SSE events; they share that read's timestamp (what the client truly
observed). Per ``vllm bench serve``: TTFT is the time to the first chunk with
non-empty text, every later non-empty chunk appends its gap to ITL, output tokens come
from the final usage chunk (``stream_options.include_usage``) or, failing that, from
the number of non-empty chunks.

Completions requests send ``max_tokens = output_tokens`` and ``ignore_eos: true`` so
output lengths are exact; chat requests send one user message. A background ticker
measures the client's own event-loop lag so reports can warn when the client, not the
server, was the bottleneck. The server's ``/metrics`` page is read before the first
request and after the last one for the run's prefix-cache hit rate
(``kiloserve.bench.prefix_cache``). Prompts, headers and keys are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
import orjson

from kiloserve.bench.lag import LagMonitor
from kiloserve.bench.prefix_cache import PrefixCacheProbe
from kiloserve.bench.stream import StreamState
from kiloserve.errors import ConfigError
from kiloserve.results.records import BenchResult, RequestRecord
from kiloserve.workload import ArrivalMode, ClosedLoop, RequestSpec, Workload
from kiloserve.workload.digest import WorkloadDigest

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENDPOINTS",
    "ClientOptions",
    "ProgressCounts",
    "base_url",
    "run_bench",
]

logger = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BACKEND_HEADER = "x-kiloserve-backend"
MAX_ERROR_CHARS = 300
DEFAULT_TIMEOUT_S = 600.0  # per request; every CLI's --timeout defaults to it


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How requests are built and sent."""

    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    ignore_eos: bool = True


@dataclass(slots=True)
class ProgressCounts:
    """Live counts passed to the progress callback."""

    num_sent: int = 0
    num_done: int = 0
    num_failed: int = 0
    num_in_flight: int = 0
    total: int | None = None
    elapsed_s: float = 0.0


ProgressHook = Callable[[ProgressCounts], None]


async def run_bench(
    url: str,
    model: str,
    workload: Workload,
    arrival: ArrivalMode,
    *,
    options: ClientOptions | None = None,
    duration_s: float | None = None,
    on_progress: ProgressHook | None = None,
    progress_interval_s: float = 0.25,
    stop: asyncio.Event | None = None,
) -> BenchResult:
    """Send ``workload`` to the OpenAI-compatible server at ``url``; return all records.

    ``arrival`` is ``OpenLoop`` (send at each spec's ``arrival_s``) or ``ClosedLoop``
    (keep N in flight). ``duration_s`` stops sending new requests after that long
    (in-flight ones finish); needed for unbounded closed-loop workloads. Setting
    ``stop`` does the same at any time (the CLI sets it on the first Ctrl-C); the
    result's ``config["stopped_early"]`` says so.
    """
    opts = options or ClientOptions()
    target = endpoint_url(url, opts.endpoint)
    _check_run(workload, arrival, duration_s)
    max_conns = _max_connections(arrival)
    _raise_fd_limit(max_conns)
    connector = aiohttp.TCPConnector(limit=max_conns, limit_per_host=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector, headers=_headers(opts)) as session:
        probe = PrefixCacheProbe(session, base_url(url))
        await probe.start()
        run = _Run(target, model, opts, workload.num_requests, stop or asyncio.Event())
        run.session = session
        monitor = LagMonitor(on_tick=run.tick(on_progress), tick_interval_s=progress_interval_s)
        async with monitor:
            if isinstance(arrival, ClosedLoop):
                await run.closed_loop(iter(workload), arrival.concurrency, duration_s)
            else:
                await run.open_loop(iter(workload), arrival.max_concurrency, duration_s)
        ended_s = time.perf_counter()
        run_s = ended_s - run.t0
        if on_progress is not None:
            on_progress(run.counts)
        prefix_cache = await probe.finish(ended_s)
    return BenchResult(
        records=sorted(run.records, key=lambda r: r.start_s),
        duration_s=run_s,
        started_at_unix=run.started_at_unix,
        client=monitor.stats(run.max_in_flight),
        config=_describe_run(url, model, opts, arrival, duration_s) | run.stopped(),
        workload=workload.describe(),
        workload_digest=run.digest.hexdigest(),
        prefix_cache=prefix_cache,
    )


def endpoint_url(url: str, endpoint: str) -> str:
    """Full URL of ``endpoint`` on a server given as ``http://host:port`` (or ``.../v1``)."""
    if endpoint not in ENDPOINTS:
        raise ConfigError(f"unknown endpoint {endpoint!r}; valid: {', '.join(ENDPOINTS)}")
    return base_url(url) + ENDPOINTS[endpoint]


def base_url(url: str) -> str:
    """The server root of ``url`` (``http://host:port``, any ``/v1`` suffix removed)."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https://, got {url!r}")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base


def build_body(spec: RequestSpec, model: str, opts: ClientOptions) -> bytes:
    """The JSON body of one streaming request."""
    body: dict[str, object] = {
        "model": model,
        "max_tokens": spec.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.user is not None:
        body["user"] = spec.user
    return orjson.dumps(body)


class _Run:
    """State of one run: the session, counters, records and the workload digest."""

    def __init__(
        self, target: str, model: str, opts: ClientOptions, total: int | None, stop: asyncio.Event
    ) -> None:
        self.target, self.model, self.opts, self.stop = target, model, opts, stop
        self.session: aiohttp.ClientSession | None = None
        self.records: list[RequestRecord] = []
        self.counts = ProgressCounts(total=total)
        self.digest = WorkloadDigest()
        self.max_in_flight = 0
        self.started_at_unix = time.time()
        self.t0 = time.perf_counter()

    def stopped(self) -> dict[str, object]:
        return {"stopped_early": self.stop.is_set()}

    async def wait_until(self, at_s: float) -> None:
        """Sleep until ``t0 + at_s`` or until ``stop`` is set."""
        delay_s = self.t0 + at_s - time.perf_counter()
        if delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay_s)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def tick(self, on_progress: ProgressHook | None) -> Callable[[], None]:
        def _tick() -> None:
            if on_progress is not None:
                self.counts.elapsed_s = self.elapsed_s()
                on_progress(self.counts)

        return _tick

    async def open_loop(
        self, specs: Iterator[RequestSpec], max_concurrency: int | None, duration_s: float | None
    ) -> None:
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        tasks: set[asyncio.Task[None]] = set()
        for spec in specs:
            if spec.arrival_s is None:
                raise ConfigError("open-loop run needs arrival times; give a rate or concurrency")
            if duration_s is not None and spec.arrival_s >= duration_s:
                break
            await self.wait_until(spec.arrival_s)
            if self.stop.is_set():
                break
            if sem is not None:
                await sem.acquire()
            task = asyncio.create_task(self.send(spec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if sem is not None:
                task.add_done_callback(lambda _t: sem.release())
        if tasks:
            await asyncio.gather(*tasks)

    async def closed_loop(
        self, specs: Iterator[RequestSpec], concurrency: int, duration_s: float | None
    ) -> None:
        deadline = None if duration_s is None else self.t0 + duration_s

        async def worker() -> None:
            while (deadline is None or time.perf_counter() < deadline) and not self.stop.is_set():
                spec = next(specs, None)
                if spec is None:
                    return
                await self.send(spec)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def send(self, spec: RequestSpec) -> None:
        """Send one request and record what happened (never raises)."""
        session = self.session
        if session is None:
            raise RuntimeError("run has no session")
        self.digest.add(spec)
        body = build_body(spec, self.model, self.opts)
        start = time.perf_counter()
        record = _new_record(spec, start - self.t0)
        state = StreamState(start, is_chat=self.opts.endpoint == "chat")
        self._started()
        try:
            async with asyncio.timeout(self.opts.timeout_s):
                await self._stream(session, body, record, state)
        except TimeoutError:
            record.is_timeout, record.error = True, f"timeout after {self.opts.timeout_s:g} s"
            record.ttft_s = state.ttft_s  # if the first token came in time (metrics use it)
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        if record.e2e_s is None or not record.is_ok:  # failures: time until the failure
            record.e2e_s = time.perf_counter() - start
        if not record.is_ok:
            logger.debug("request %s failed: %s", record.request_id, record.error)
        self._finished(record)

    async def _stream(
        self, session: aiohttp.ClientSession, body: bytes, record: RequestRecord, state: StreamState
    ) -> None:
        async with session.post(self.target, data=body) as resp:
            record.status = resp.status
            record.backend = resp.headers.get(BACKEND_HEADER)
            if resp.status != 200:
                text = await resp.text(errors="replace")
                record.error = f"HTTP {resp.status}: {text}"[:MAX_ERROR_CHARS]
                return
            # read to the end of the body (not just [DONE]) so the connection is reused
            async for data in resp.content.iter_any():
                state.feed(data, time.perf_counter())
            state.finish(record)

    def _started(self) -> None:
        c = self.counts
        c.num_sent += 1
        c.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, c.num_in_flight)

    def _finished(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.counts.num_in_flight -= 1
        self.counts.num_done += 1
        if not record.is_ok:
            self.counts.num_failed += 1


def _new_record(spec: RequestSpec, start_s: float) -> RequestRecord:
    return RequestRecord(
        request_id=spec.request_id,
        scheduled_s=spec.arrival_s,
        start_s=start_s,
        input_tokens=spec.input_tokens,
        max_tokens=spec.output_tokens,
        session_id=spec.session_id,
        user=spec.user,
        prefix_group=spec.prefix_group,
    )


def _headers(opts: ClientOptions) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    api_key = opts.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _check_run(workload: Workload, arrival: ArrivalMode, duration_s: float | None) -> None:
    if isinstance(arrival, ClosedLoop) and arrival.concurrency < 1:
        raise ConfigError(f"concurrency must be >= 1, got {arrival.concurrency}")
    if not workload.is_bounded and duration_s is None:
        raise ConfigError("an unbounded workload needs a duration (--duration)")


def _max_connections(arrival: ArrivalMode) -> int:
    if isinstance(arrival, ClosedLoop):
        return arrival.concurrency
    return arrival.max_concurrency or 0  # 0: no limit


def _describe_run(
    url: str, model: str, opts: ClientOptions, arrival: ArrivalMode, duration_s: float | None
) -> dict[str, object]:
    """The run's configuration as recorded in reports (no API key)."""
    return {
        "url": url,
        "model": model,
        "endpoint": opts.endpoint,
        "timeout_s": opts.timeout_s,
        "arrival": _describe_arrival(arrival),
        "duration_s": duration_s,
    }


def _describe_arrival(arrival: ArrivalMode) -> dict[str, object]:
    if isinstance(arrival, ClosedLoop):
        return {"mode": "closed", "concurrency": arrival.concurrency}
    return {"mode": "open", "max_concurrency": arrival.max_concurrency}


def _raise_fd_limit(max_conns: int) -> None:
    """Lift the soft open-files limit towards the hard one for many concurrent streams."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if max_conns == 0 else min(hard, max_conns + 1024)
    if hard == resource.RLIM_INFINITY:
        want = max(soft, max_conns + 1024)
    if want > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
