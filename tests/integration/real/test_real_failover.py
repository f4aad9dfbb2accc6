"""A vLLM instance killed mid-run: the gateway fails over to the other one.

Requests not yet answered are retried; streams already under way on the killed engine
are continued on the survivor (mid-stream failover, docs/gateway.md): every stream ends
with all its tokens and one ``[DONE]``. Runs last in the session (conftest orders it
so): it leaves vllm-b dead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import openai
import pytest

from conftest import SERVED_MODEL, admin_backends, http_text, metric_sum, wait_for
from kiloserve.launch.cluster import LocalCluster

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

NUM_WORKERS = 3
NUM_STREAM_WORKERS = 3
STREAM_TOKENS = 64
MIN_REQUESTS_AFTER_KILL = 12


@dataclass(frozen=True)
class Outcome:
    start_s: float
    backend: str | None
    error: str | None


def _worker(
    gateway_url: str, outcomes: list[Outcome], lock: threading.Lock, stop: threading.Event
) -> None:
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0) as client:
        i = 0
        while not stop.is_set():
            i += 1
            start_s = time.monotonic()
            try:
                raw = client.completions.with_raw_response.create(
                    model=SERVED_MODEL,
                    prompt=f"Kill one engine, keep serving {i}",
                    max_tokens=24,
                    extra_body={"ignore_eos": True},
                )
                done = raw.parse()
                assert done.usage is not None and done.usage.completion_tokens == 24
                outcome = Outcome(start_s, raw.headers["x-kiloserve-backend"], None)
            except openai.APIError as exc:
                outcome = Outcome(start_s, None, type(exc).__name__)
            with lock:
                outcomes.append(outcome)


@dataclass
class StreamOutcome:
    backend: str | None = None
    num_text_chunks: int = 0
    completion_tokens: int | None = None
    error: str | None = None
    done: bool = False


def _stream_worker(
    gateway_url: str, outcomes: list[StreamOutcome], lock: threading.Lock, stop: threading.Event
) -> None:
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key="none", max_retries=0) as client:
        i = 0
        while not stop.is_set():
            i += 1
            out = StreamOutcome()
            with lock:
                outcomes.append(out)
            try:
                raw = client.completions.with_raw_response.create(
                    model=SERVED_MODEL,
                    prompt=f"Stream through a crash, number {i}",
                    max_tokens=STREAM_TOKENS,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                out.backend = raw.headers["x-kiloserve-backend"]
                for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].text:
                        out.num_text_chunks += 1
                    if chunk.usage is not None:
                        out.completion_tokens = chunk.usage.completion_tokens
                out.done = True
            except openai.APIError as exc:
                out.error = type(exc).__name__


def _half_way_on_victim(streams: list[StreamOutcome]) -> bool:
    return any(
        o.backend == "vllm-b" and not o.done and o.error is None
        and 3 <= o.num_text_chunks < STREAM_TOKENS // 2
        for o in list(streams)
    )  # fmt: skip


def _freeze_with_a_stream_half_way(pgid: int, streams: list[StreamOutcome]) -> None:
    """Stop vllm-b (SIGSTOP) while a stream on it is half-way AND unfinished. A client
    that has read 3 of a stream's chunks may be far behind the engine (the tiny model
    writes 64 tokens in milliseconds; on a busy box the client threads lag), so the
    stream may be complete at the gateway already and a kill would cut nothing: after
    the stop, once what vllm-b sent has had time to reach the clients, a stream on it
    still unfinished is one the engine never finished. Else resume it and try again."""
    deadline = time.monotonic() + 120
    while True:
        wait_for(lambda: _half_way_on_victim(streams), 120, "a stream under way on vllm-b",
                 poll_s=0.001)  # fmt: skip
        os.killpg(pgid, signal.SIGSTOP)
        time.sleep(1.5)  # what it sent reaches the clients; it sends nothing more
        if any(o.backend == "vllm-b" and not o.done and o.error is None
               and o.num_text_chunks >= 1 for o in list(streams)):  # fmt: skip
            return
        os.killpg(pgid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError("no stream on vllm-b was ever cut half-way")


def test_engine_killed_mid_run_fails_over(vllm_cluster: LocalCluster) -> None:
    gw = vllm_cluster.gateway_url
    assert gw is not None
    victim = next(c for c in vllm_cluster.children if c.name == "vllm-b")
    assert victim.pid is not None
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()
    streams: list[StreamOutcome] = []
    workers = [
        threading.Thread(target=_worker, args=(gw, outcomes, lock, stop))
        for _ in range(NUM_WORKERS)
    ] + [
        threading.Thread(target=_stream_worker, args=(gw, streams, lock, stop))
        for _ in range(NUM_STREAM_WORKERS)
    ]
    for w in workers:
        w.start()
    try:
        wait_for(
            lambda: {o.backend for o in outcomes} >= {"vllm-a", "vllm-b"},
            120,
            "both engines to serve the run",
        )
        _freeze_with_a_stream_half_way(victim.pid, streams)
        killed_s = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)  # the API server and its engine core, no goodbye
        wait_for(
            lambda: sum(1 for o in outcomes if o.start_s >= killed_s) >= MIN_REQUESTS_AFTER_KILL,
            180,
            "requests after the kill",
        )
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=240)
    assert not any(w.is_alive() for w in workers)
    before = [o for o in outcomes if o.start_s < killed_s]
    after = [o for o in outcomes if o.start_s >= killed_s]
    # Every request sent after the kill is served, by the survivor.
    assert [o.error for o in after] == [None] * len(after)
    assert {o.backend for o in after} == {"vllm-a"}
    # At most the requests in flight on vllm-b at the kill fail (their stream was cut).
    assert sum(1 for o in before if o.error) <= NUM_WORKERS
    wait_for(lambda: not admin_backends(gw)["vllm-b"]["healthy"], 20, "vllm-b marked down")
    assert ("vllm-b", -signal.SIGKILL) in vllm_cluster.crashed()
    # No stream failed: those cut on vllm-b went on on vllm-a with every token.
    finished = [o for o in streams if o.done or o.error]
    assert [o.error for o in finished] == [None] * len(finished)
    assert all(o.completion_tokens == STREAM_TOKENS for o in finished), [
        (o.backend, o.num_text_chunks, o.completion_tokens) for o in finished
    ]
    migrated = metric_sum(http_text(gw + "/metrics"), "kiloserve_gateway_migrations_total")
    assert migrated >= 1
