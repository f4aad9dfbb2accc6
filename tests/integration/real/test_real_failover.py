"""A vLLM instance killed mid-run: the gateway fails over to the other one.

Runs last in the session (conftest orders it so): it leaves vllm-b dead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import openai
import pytest

from conftest import SERVED_MODEL, admin_backends, wait_for
from kiloserve.launch.cluster import LocalCluster

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

NUM_WORKERS = 3
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


def test_engine_killed_mid_run_fails_over(vllm_cluster: LocalCluster) -> None:
    gw = vllm_cluster.gateway_url
    assert gw is not None
    victim = next(c for c in vllm_cluster.children if c.name == "vllm-b")
    assert victim.pid is not None
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()
    workers = [
        threading.Thread(target=_worker, args=(gw, outcomes, lock, stop))
        for _ in range(NUM_WORKERS)
    ]
    for w in workers:
        w.start()
    try:
        wait_for(
            lambda: {o.backend for o in outcomes} >= {"vllm-a", "vllm-b"},
            120,
            "both engines to serve the run",
        )
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
