"""Two real vLLM (CPU) instances behind the kiloserve gateway, through the openai SDK.

The model is tiny and random (scripts/make_tiny_model.py): tests assert on protocol,
token accounting, metrics and routing, never on text. ``ignore_eos`` makes every
completion exactly ``max_tokens`` long.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from conftest import (
    MAX_NUM_SEQS,
    SERVED_MODEL,
    admin_backends,
    http_json,
    http_text,
    metric_sum,
    wait_for,
)
from kiloserve.launch.cluster import LocalCluster

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

PROMPT = "Return a list of the words in the string, using sep as the delimiter string."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Split the string on whitespace. ü€"},
]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def gateway(vllm_cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    assert vllm_cluster.gateway_url is not None
    with openai.OpenAI(base_url=vllm_cluster.gateway_url + "/v1", api_key="none") as client:
        yield client


def _engine(cluster: LocalCluster, name: str) -> str:
    return next(b.url for b in cluster.backends if b.name == name)


def _num_prompt_tokens(cluster: LocalCluster, body: dict[str, object]) -> int:
    """vLLM's own count, from its /tokenize endpoint."""
    reply = http_json(_engine(cluster, "vllm-a") + "/tokenize", {"model": SERVED_MODEL, **body})
    return int(reply["count"])


def test_models_and_engine_dialect(vllm_cluster: LocalCluster) -> None:
    gw = vllm_cluster.gateway_url
    assert gw is not None
    models = http_json(gw + "/v1/models")
    assert SERVED_MODEL in [m["id"] for m in models["data"]]
    config = http_json(gw + "/admin/config")
    assert {b["name"]: b["engine"] for b in config["backends"]} == {
        "vllm-a": "vllm",
        "vllm-b": "vllm",
    }
    rows = admin_backends(gw)
    wait_for(lambda: admin_backends(gw)["vllm-a"]["num_running"] is not None, 10, "a scrape")
    assert rows.keys() == {"vllm-a", "vllm-b"}


def test_completion_usage_matches_vllm(vllm_cluster: LocalCluster, gateway: openai.OpenAI) -> None:
    raw = gateway.completions.with_raw_response.create(
        model=SERVED_MODEL, prompt=PROMPT, max_tokens=12, extra_body=NO_EOS
    )
    backend = raw.headers["x-kiloserve-backend"]
    assert backend in ("vllm-a", "vllm-b")
    done = raw.parse()
    assert done.usage is not None
    assert done.usage.prompt_tokens == _num_prompt_tokens(vllm_cluster, {"prompt": PROMPT})
    assert done.usage.completion_tokens == 12
    assert done.choices[0].finish_reason == "length"


def test_streaming_completion_usage(vllm_cluster: LocalCluster, gateway: openai.OpenAI) -> None:
    stream = gateway.completions.create(
        model=SERVED_MODEL,
        prompt=PROMPT,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    assert usage[0].completion_tokens == 20
    assert usage[0].prompt_tokens == _num_prompt_tokens(vllm_cluster, {"prompt": PROMPT})
    text_chunks = [c for c in chunks if c.choices]
    # vLLM merges tokens into fewer events when its API server lags: >= 1 text event.
    assert text_chunks and text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)


def test_chat_usage_matches_vllm(vllm_cluster: LocalCluster, gateway: openai.OpenAI) -> None:
    expected = _num_prompt_tokens(vllm_cluster, {"messages": MESSAGES})
    done = gateway.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=8, extra_body=NO_EOS
    )  # type: ignore[call-overload]
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (expected, 8)
    assert done.choices[0].message.role == "assistant"
    stream = gateway.chat.completions.create(
        model=SERVED_MODEL,
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )  # type: ignore[call-overload]
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(expected, 8)]


def test_engine_counters_match_client_usage(
    vllm_cluster: LocalCluster, gateway: openai.OpenAI
) -> None:
    """vLLM's prompt/generation token counters grow by exactly what clients were billed."""
    urls = [b.url for b in vllm_cluster.backends]

    def totals() -> tuple[float, float]:
        pages = [http_text(u + "/metrics") for u in urls]
        prompt = sum(metric_sum(p, "vllm:prompt_tokens_total") for p in pages)
        generated = sum(metric_sum(p, "vllm:generation_tokens_total") for p in pages)
        return prompt, generated

    before = totals()
    billed_prompt = billed_generated = 0
    for i in range(6):
        done = gateway.completions.create(
            model=SERVED_MODEL, prompt=f"{PROMPT} {i}", max_tokens=5 + i, extra_body=NO_EOS
        )
        assert done.usage is not None
        billed_prompt += done.usage.prompt_tokens
        billed_generated += done.usage.completion_tokens
    after = totals()
    assert after[1] - before[1] == billed_generated == sum(5 + i for i in range(6))
    assert after[0] - before[0] == billed_prompt


def test_unknown_model_is_404(gateway: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        gateway.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def _num_running(url: str) -> float:
    return metric_sum(http_text(url + "/metrics"), "vllm:num_requests_running")


def _num_waiting(url: str) -> float:
    return metric_sum(http_text(url + "/metrics"), "vllm:num_requests_waiting")


@contextlib.contextmanager
def _held(url: str, num_requests: int, max_tokens: int) -> Iterator[None]:
    """Long requests straight to one engine (not through the gateway), each on its own
    socket; leaving the block closes the sockets, and vLLM aborts what they asked for
    (running or still queued), so the engine is idle again in seconds, not minutes."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    body = json.dumps(
        {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": max_tokens, **NO_EOS}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks: list[socket.socket] = []
    try:
        for _ in range(num_requests):
            sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
            socks.append(sock)
            sock.sendall(head + body)
        yield
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        # Aborted requests leave at the engine's next step; a build that ignored the
        # disconnects would instead finish them (still within this wait).
        wait_for(lambda: _num_running(url) == 0 and _num_waiting(url) == 0, 240, "vllm-a to idle")


def _fair_view(rows: dict[str, Any], max_age_s: float = 2.0) -> bool:
    """Whether the gateway's view of both engines was one a load decision can rest on:
    both healthy and both scraped well within ``max_age_s`` (one CI run had both marked
    down by starved probes and their last good scrapes 7 s old)."""
    return all(
        row["healthy"] and row["scrape_age_s"] is not None and row["scrape_age_s"] <= max_age_s
        for row in (rows["vllm-a"], rows["vllm-b"])
    )


def _steer_attempt(
    vllm_cluster: LocalCluster, gateway: openai.OpenAI
) -> tuple[list[str], dict[str, Any]]:
    """Queue work straight on vllm-a, then send gateway requests while the gateway's
    scrape still shows that queue; returns where they went and the admin rows."""
    gw = vllm_cluster.gateway_url
    assert gw is not None
    url_a = _engine(vllm_cluster, "vllm-a")
    served: list[str] = []  # requests decided while the gateway saw both engines
    excluded: list[str] = []  # requests during which vllm-b's scrape failed
    took_s: list[float] = []
    # A deep queue (2 run, 78 wait, 460 tokens each): vllm-a (pinned to its own core)
    # decodes 450-800 tokens/s even with every core busy, so this lasts 45-80 s, while
    # one gateway request to a CPU-starved vllm-b took 14 s; leaving the block aborts
    # what is left of it.
    with _held(url_a, 40 * MAX_NUM_SEQS, max_tokens=460):
        try:
            wait_for(lambda: _num_waiting(url_a) >= 2, 60, "vllm-a to queue requests")
        except AssertionError:
            load_1m, num_cpus = os.getloadavg()[0], os.cpu_count() or 1
            if load_1m <= num_cpus:
                raise
            # The precondition (a queue on the engine) is vLLM's, not ours: on a machine
            # whose cores other jobs own, it may never build in time.
            pytest.skip(f"vllm-a built no queue in 60 s at load average {load_1m:.1f}")

        def queue_seen(row: dict[str, Any]) -> bool:
            return row["num_running"] == MAX_NUM_SEQS and (row["num_waiting"] or 0) >= 2

        try:
            wait_for(lambda: queue_seen(admin_backends(gw)["vllm-a"]), 15, "a scrape of the queue")
        except AssertionError:
            # vllm-a's queue never reached the gateway's view (its /metrics kept timing
            # out on a starved box, as in one CI run): no request of this attempt counts
            return [], {"excluded": ["no scrape showed vllm-a's queue in 15 s"]}
        for i in range(6):
            before = admin_backends(gw)
            if (before["vllm-a"]["num_waiting"] or 0) < 1:
                break  # vllm-a drained: no longer a fair question
            # Fresh prompts: no prefix affinity to either engine, only load decides.
            started = time.monotonic()
            raw = gateway.completions.with_raw_response.create(
                model=SERVED_MODEL, prompt=f"steer {i} away", max_tokens=2, extra_body=NO_EOS
            )
            took_s.append(round(time.monotonic() - started, 2))
            errors = admin_backends(gw)["vllm-b"]["num_scrape_errors_total"]
            if errors != before["vllm-b"]["num_scrape_errors_total"] or not _fair_view(before):
                # vllm-b's /metrics timed out meanwhile (a CPU-starved API server), or the
                # gateway's view was stale or had a backend marked down by its probes:
                # it saw load it could not trust and may rightly have chosen either
                excluded.append(raw.headers["x-kiloserve-backend"])
                continue
            served.append(raw.headers["x-kiloserve-backend"])
        keys = ("num_running", "num_waiting", "scrape_age_s", "healthy", "unhealthy_reasons")
        rows: dict[str, Any] = {n: {k: r[k] for k in keys} for n, r in admin_backends(gw).items()}
        rows["took_s"], rows["excluded"] = took_s, excluded
        return served, rows


def test_scraped_queueing_steers_load(vllm_cluster: LocalCluster, gateway: openai.OpenAI) -> None:
    """vllm-a's visible queue (max-num-seqs 2) sends gateway traffic to vllm-b.

    Eighty long requests go straight to vllm-a (2 run, 78 wait); while the gateway's
    scraped view still shows vllm-a queueing, every gateway request must go to vllm-b.
    Two CPU-build vLLMs share two cores here: a starved engine's /metrics can time out
    (then it is unknown, never idle, and the policy rightly avoids it), so a request
    during which vllm-b's scrape failed does not count, and the scenario gets two more
    attempts before the assertion stands. A request that counts and goes to vllm-a
    always fails the test; when every attempt was left with fewer than two requests
    that count because the engines' scrapes kept timing out (CI saw one 2-token request
    take 25 s, and once no scrape of vllm-a's queue in 15 s), the box cannot answer the
    question and the test skips, saying so.
    """
    failures, is_starved = [], True
    for _attempt in range(3):
        served, rows = _steer_attempt(vllm_cluster, gateway)
        if served == ["vllm-b"] * len(served) and len(served) >= 2:
            return
        failures.append(str((served, rows)))
        is_starved = is_starved and served == ["vllm-b"] * len(served) and bool(rows["excluded"])
    if is_starved:
        pytest.skip(f"vllm-b's /metrics timed out during the requests of every attempt: {failures}")
    raise AssertionError("; ".join(failures))


def test_disconnect_aborts_on_engine(vllm_cluster: LocalCluster, gateway: openai.OpenAI) -> None:
    """Closing a stream mid-way through the gateway stops generation on the engine.

    vLLM 0.32 does not count client aborts in ``request_success_total{finished_reason=
    "abort"}`` (its output processor drops the request's stats on abort; checked on this
    build), so the abort shows as: the request leaves the batch, never finishes with
    ``length``, and the generation counter stops below ``max_tokens`` (how far below
    depends on how soon the disconnect reaches the engine: usually under half, but one
    CI run on a starved box saw 374 of 440; ``max_model_len`` is 512, so no longer run).
    """
    max_tokens = 440
    urls = {b.name: b.url for b in vllm_cluster.backends}

    def counters(url: str) -> tuple[float, float, float]:
        page = http_text(url + "/metrics")
        done = metric_sum(page, "vllm:request_success_total", finished_reason="length")
        aborted = metric_sum(page, "vllm:request_success_total", finished_reason="abort")
        return done, aborted, metric_sum(page, "vllm:generation_tokens_total")

    # Earlier tests' last finishes may still be on their way to /metrics (a CPU-starved
    # engine publishes them late): settle until the counters hold still for a second.
    for url in urls.values():
        wait_for(lambda url=url: _num_running(url) == 0, 120, "idle engines")
    before = {name: counters(url) for name, url in urls.items()}
    for _ in range(15):
        time.sleep(1.0)
        now = {name: counters(url) for name, url in urls.items()}
        if now == before:
            break
        before = now
    stream = gateway.completions.with_streaming_response.create(
        model=SERVED_MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True, extra_body=NO_EOS
    )
    with stream as resp:
        backend = resp.headers["x-kiloserve-backend"]
        lines = resp.iter_lines()
        num_data = sum(1 for _, line in zip(range(6), lines, strict=False) if line)
        assert num_data >= 3
    url = urls[backend]
    wait_for(lambda: _num_running(url) == 0, 30, "the aborted request to leave the batch")
    time.sleep(0.5)  # let the last iteration stats reach /metrics
    done, aborted, generated = counters(url)
    load_1m, num_cpus = os.getloadavg()[0], os.cpu_count() or 1
    if done != before[backend][0] and load_1m > num_cpus:
        # vLLM's CPU build makes these 440 tokens in well under a second; on a machine
        # whose cores other jobs own the disconnect can reach it after the last one
        # (CI once saw 374 of 440 before it landed), so the question has no answer here
        pytest.skip(f"the request finished before the disconnect landed (load {load_1m:.1f})")
    assert done == before[backend][0], "the request ran to max_tokens: not aborted"
    assert aborted - before[backend][1] in (0, 1)
    assert 3 <= generated - before[backend][2] < max_tokens - 1
