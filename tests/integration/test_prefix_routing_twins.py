"""Exact prefix routing end to end on twins: two engine twins publish KV events
(``kv_events_endpoint: auto``) and report their prefix-cache hits
(``--enable-prompt-tokens-details``); the gateway (default policy) subscribes, routes
on the exact index and says in ``x-kiloserve-prefix-cached-tokens`` how many prompt
tokens it expects the answering backend to hold. Each answer's engine-side
``usage.prompt_tokens_details.cached_tokens`` must agree (real processes, started by
``LocalCluster``, the code ``kiloserve up`` runs)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiloserve.gateway.headers import BACKEND_HEADER, CACHED_TOKENS_HEADER
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config
from kiloserve.tokens import filler_text
from worker_urls import gateway_workers, merged_kv_rows

pytestmark = pytest.mark.timeout(90)

MODEL = "twin-8b"  # the served name
BLOCK = 16  # the gateway's block_size (default) and the twins'
NUM_TENANTS = 4
NUM_REQUESTS = 40
HEAD_TOKENS = 600
HEADS = [filler_text(HEAD_TOKENS, seed=100 + t) for t in range(NUM_TENANTS)]
BACKENDS = ("tw-0", "tw-1")


def _cluster_config() -> Any:
    return parse_cluster_config(
        {
            "name": "prefix-twins",
            "gateway": {"port": 0},  # the default policy
            "backends": [
                {
                    "name": "tw",
                    "gpu": "H100",
                    "model": "llama-3.1-8b",
                    "served_model_name": MODEL,
                    "count": 2,
                    "kv_events_endpoint": "auto",
                    "kv_events_replay_endpoint": "auto",
                    "extra_args": ["--enable-prompt-tokens-details"],
                }
            ],
        }
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    options = {"scrape_interval_s": 0.1}
    with LocalCluster(
        _cluster_config(), gateway=True, gateway_port=0, run_dir=tmp_path, gateway_options=options
    ) as c:
        yield c


# --- HTTP helpers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    backend: str
    predicted: int  # the gateway's x-kiloserve-prefix-cached-tokens
    cached: int  # the engine's usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        return {k.lower(): v for k, v in resp.headers.items()}, json.load(resp)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def complete(base_url: str, prompt: str) -> Answer:
    """One completion through the gateway (or straight to an engine)."""
    headers, body = _post(
        base_url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    )
    usage = body["usage"]
    return Answer(
        backend=headers.get(BACKEND_HEADER, ""),
        predicted=int(headers.get(CACHED_TOKENS_HEADER, "-1")),
        cached=int(usage["prompt_tokens_details"]["cached_tokens"]),
        prompt_tokens=int(usage["prompt_tokens"]),
    )


def route(gateway_url: str, prompt: str) -> Answer:
    """``complete`` through the gateway, then wait until the gateway has indexed the
    blocks the twin stored for it (the whole blocks of the prompt and the first output
    token past the predicted ones; fewer by one when the prediction was capped by the
    last-token rule and the prompt's last block was held already). The twin publishes a
    step's events before it answers, but the gateway may apply them just after the
    client has the answer; the next request must not race them."""
    before = kv_rows(gateway_url)
    answer = complete(gateway_url, prompt)
    num_prompt, predicted = answer.prompt_tokens, answer.predicted
    most = before[answer.backend]["blocks"] + (num_prompt + 1) // BLOCK - predicted // BLOCK
    fewest = most - int(num_prompt % BLOCK == 0 and predicted == num_prompt - BLOCK)

    def indexed() -> bool:
        return bool(kv_rows(gateway_url)[answer.backend]["blocks"] >= fewest)

    wait_for(indexed, 10, f"{answer} indexed")
    row = kv_rows(gateway_url)[answer.backend]
    assert fewest <= row["blocks"] <= row["max_blocks"] <= most, answer
    return answer


def kv_rows(gateway_url: str) -> dict[str, dict[str, Any]]:
    """The gateway's KV-event rows as its slowest worker holds them (each worker of
    ``--workers N`` has its own subscriber and index, and the next request may reach
    any of them): ``worker_urls.merged_kv_rows``."""
    urls = gateway_workers(gateway_url)
    return merged_kv_rows([_get(u + "/admin/config")["kv_events"] for u in urls])


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def warm_up(cluster: LocalCluster) -> str:
    """One unrelated request straight to each twin (its first KV-event batch), then
    wait until the gateway applies both streams: every backend ``exact``."""
    gw = cluster.gateway_url
    assert gw is not None
    for i, backend in enumerate(cluster.backends):
        complete(backend.url, filler_text(40, seed=900 + i))
    wait_for(
        lambda: all(kv_rows(gw)[b]["mode"] == "exact" for b in BACKENDS),
        15,
        "both backends exact",
    )
    return gw


def tenant_prompt(tenant: int, request: int) -> str:
    return HEADS[tenant] + " " + filler_text(8 + request % 9, seed=1000 + request)


def assert_agrees(answer: Answer, what: str) -> None:
    """The gateway's prediction equals the engine's hits (to within one block)."""
    assert answer.predicted >= 0, f"{what}: no {CACHED_TOKENS_HEADER} header"
    assert answer.predicted % BLOCK == 0
    assert answer.predicted < answer.prompt_tokens
    assert abs(answer.predicted - answer.cached) <= BLOCK, f"{what}: {answer}"


# --- the tests ---------------------------------------------------------------------------


def test_predicted_cached_tokens_match_the_engines(cluster: LocalCluster) -> None:
    gw = warm_up(cluster)
    answers: list[tuple[int, Answer]] = []
    for i in range(NUM_REQUESTS):
        tenant = i % NUM_TENANTS
        answer = route(gw, tenant_prompt(tenant, i))
        assert_agrees(answer, f"request {i} (tenant {tenant})")
        answers.append((tenant, answer))
    exact = sum(a.predicted == a.cached for _, a in answers)
    assert exact == NUM_REQUESTS, [a for _, a in answers if a.predicted != a.cached]
    # a tenant's first request finds nothing; most later ones go where the head is
    firsts = answers[:NUM_TENANTS]
    assert all(a.cached == 0 and a.predicted == 0 for _, a in firsts)
    later = [a for _, a in answers[NUM_TENANTS:]]
    full_head = HEAD_TOKENS // BLOCK * BLOCK
    num_hits = sum(a.cached >= full_head for a in later)
    assert num_hits >= 0.8 * len(later), later
    rows = kv_rows(gw)
    assert all(rows[b]["mode"] == "exact" and rows[b]["gaps"] == 0 for b in BACKENDS), rows


def test_restarted_twin_loses_its_entries_and_rebuilds_them(cluster: LocalCluster) -> None:
    gw = warm_up(cluster)
    for i in range(2 * NUM_TENANTS):  # every tenant's head cached somewhere
        assert_agrees(route(gw, tenant_prompt(i % NUM_TENANTS, i)), f"request {i}")
    rows = kv_rows(gw)
    victim = max(BACKENDS, key=lambda b: rows[b]["blocks"])
    assert rows[victim]["blocks"] > 0
    before = rows[victim]
    index = BACKENDS.index(victim)
    child = cluster.children[index]
    assert child.proc is not None
    os.killpg(child.proc.pid, signal.SIGKILL)  # a crash: no goodbye on any socket
    child.proc.wait(timeout=10)

    # the gateway notices (failed scrapes -> unhealthy): entries dropped, approximate
    def dropped() -> bool:
        row = kv_rows(gw)[victim]
        return bool(row["max_blocks"] == 0 and row["mode"] == "approximate")

    wait_for(dropped, 10, f"{victim}'s entries dropped")
    # requests still work while it is down (the other twin answers)
    answer = route(gw, tenant_prompt(0, 100))
    assert answer.backend != victim
    assert_agrees(answer, "while down")

    child.start()  # the same command line: same HTTP port, same KV-event sockets
    child.wait_healthy(20)
    info = cluster.backends[index]
    # new events from the restarted engine (its cache starts empty): exact again
    fresh = complete(info.url, filler_text(40, seed=950))
    assert fresh.cached == 0

    def rebuilt() -> bool:  # every worker (each has its own subscriber)
        row = kv_rows(gw)[victim]
        return bool(row["mode"] == "exact" and row["blocks"] > 0)

    wait_for(rebuilt, 15, f"{victim} exact again with new blocks")
    after = kv_rows(gw)[victim]
    assert after["blocks"] == after["max_blocks"] == 40 // BLOCK  # only the new engine's
    lost = (after["resyncs"] - before["resyncs"]) + (after["restarts"] - before["restarts"])
    assert lost >= 1, (before, after)
    text = _metrics(gw)
    assert f'kiloserve_kv_event_resyncs_total{{backend="{victim}"}}' in text

    # routing goes on, and the predictions still agree with both engines, the restarted
    # one included (it holds no tenant's head any more)
    for i in range(2 * NUM_TENANTS):
        answer = route(gw, tenant_prompt(i % NUM_TENANTS, 200 + i))
        assert_agrees(answer, f"after restart, request {i}")
        assert answer.predicted == answer.cached, answer
    # the restarted engine still answers requests sent to it, cached from its own cache
    again = complete(info.url, filler_text(40, seed=950))
    assert again.cached == 32
