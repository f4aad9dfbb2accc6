"""Exact prefix routing against two real vLLMs (CPU build): the gateway's predicted
cached prefix (``x-kiloserve-prefix-cached-tokens``) equals what the answering vLLM
reports in ``usage.prompt_tokens_details.cached_tokens``.

Two vLLM instances (one core each) publish KV events on ipc sockets in their own
folders (``kv_events_endpoint: auto``) and run with ``--enable-prompt-tokens-details``;
the gateway (default policy) tokenizes with the tiny model's own ``tokenizer.json`` and
chat template, subscribes to both and routes on the exact index. Requests are
sequential, and each waits until the gateway has indexed the blocks of the one before
(``route``).

vLLM's CPU blocks hold 128 tokens, the gateway's 16: the index splits each engine block
into 8 of its own, and counts a match in what the engine can serve: whole engine blocks,
at most the prompt's first ``n - 1`` tokens in whole engine blocks (vLLM computes the
last token). Before it did (a tenant's head ending inside an engine block, a prompt that
is a prefix of cached content) the header predicted up to 7 gateway blocks (112 tokens)
more than vLLM served on 77 of 100 requests. ``check`` asks for equality.

One pair of engines serves all three tests (module scope); the last kills one and
restarts it (40-70 s). The whole module takes 3-4 minutes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    SERVED_MODEL,
    START_TIMEOUT_S,
    RealEnv,
    http_json,
    http_text,
    metric_sum,
    vllm_backend,
    wait_for,
)
from kiloserve.gateway.headers import BACKEND_HEADER, CACHED_TOKENS_HEADER
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import ClusterConfig, parse_cluster_config
from worker_urls import gateway_workers, merged_kv_rows

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.timeout(600)]

tokenizers = pytest.importorskip("tokenizers")

BACKENDS = ("pfx-a", "pfx-b")
GATEWAY_BLOCK = 16
ENGINE_BLOCK = 128  # vLLM's CPU default (the warm-up's block count checks it)
MAX_MODEL_LEN = 1024
NUM_REQUESTS = 100
NUM_TENANTS = 5
WARM_UP_BLOCKS = 2  # engine blocks a warm-up request stores
HEAD_TOKENS = (530, 650)  # a tenant's shared head: 4 engine blocks and some
_WORD_TEXT = (
    "account agent alpha archive audit balance batch budget buffer cache cluster commit "
    "contract cursor customer daemon dataset deploy digest domain driver engine event "
    "export filter forecast gateway graph harbor index invoice journal kernel ledger "
    "market merge metric mirror module network object order packet pipeline policy "
    "portal quota queue record region replica report request router sample schema "
    "sector server session signal socket source storage stream tenant ticket token "
    "trace update vector vendor volume warehouse window worker"
)
WORDS = _WORD_TEXT.split()


def cluster_config(real_env: RealEnv) -> ClusterConfig:
    """Two vLLMs (cores 0 and 1) with KV events on ipc sockets in their own folders and
    prompt-token details; a gateway with the default policy."""
    lines = []
    for core, name in enumerate(BACKENDS):
        line = vllm_backend(name, real_env, core)
        line |= {"kv_events_endpoint": "auto", "kv_events_replay_endpoint": "auto"}
        line["extra_args"] = [*line["extra_args"], "--enable-prompt-tokens-details"]
        # the default policy scores prefixes from 512 prompt tokens on (its
        # min_prompt_tokens), past conftest's 512-token context; the tiny model has 2048
        line["max_model_len"] = MAX_MODEL_LEN
        assert line["max_num_batched_tokens"] >= MAX_MODEL_LEN
        lines.append(line)
    return parse_cluster_config({"name": "real-prefix", "gateway": {"port": 0}, "backends": lines})


def gateway_options(real_env: RealEnv) -> dict[str, Any]:
    """As ``vllm_cluster``'s (vLLM's CPU build can be slow to render /metrics when
    busy), and the tiny model's own tokenizer and chat template."""
    tokenizer = Path(real_env.model_dir) / "tokenizer.json"
    return {
        "scrape_interval_s": 0.1,
        "scrape_timeout_s": 3.0,
        "stale_after_s": 10.0,
        "models": {SERVED_MODEL: {"tokenizer": str(tokenizer)}},
    }


@pytest.fixture(scope="module")
def prefix_cluster(
    real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """The two vLLMs and the gateway, subscribed to both, for the whole module."""
    if real_env.vllm_skip:
        pytest.skip(f"real vLLM unavailable: {real_env.vllm_skip}")
    cluster = LocalCluster(
        cluster_config(real_env),
        run_dir=tmp_path_factory.mktemp("pfx"),  # short: the ipc paths go under it
        start_timeout_s=START_TIMEOUT_S,
        gateway_options=gateway_options(real_env),
    )
    with cluster:
        yield cluster


# --- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    what: str
    backend: str
    predicted: int  # the gateway's x-kiloserve-prefix-cached-tokens
    cached: int  # vLLM's usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def _usage(raw: bytes, is_stream: bool) -> dict[str, Any]:
    if not is_stream:
        usage: dict[str, Any] = json.loads(raw)["usage"]
        return usage
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    usage = json.loads(events[-2])["usage"]
    return usage


def send(base_url: str, what: str, body: dict[str, Any], is_chat: bool = False) -> Answer:
    """One request (through the gateway, or straight to an engine)."""
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    body = {"model": SERVED_MODEL, "max_tokens": 2, **body}
    headers, raw = _post(base_url + path, body)
    usage = _usage(raw, bool(body.get("stream")))
    details = usage.get("prompt_tokens_details")
    assert details is not None, f"{what}: no prompt_tokens_details in {usage}"
    return Answer(
        what=what,
        backend=headers.get(BACKEND_HEADER, ""),
        predicted=int(headers.get(CACHED_TOKENS_HEADER, "-1")),
        cached=int(details["cached_tokens"]),
        prompt_tokens=int(usage["prompt_tokens"]),
    )


def new_blocks(answer: Answer) -> tuple[int, int]:
    """(fewest, most) engine blocks the request added to the gateway's index for its
    backend: the whole blocks of its computed tokens (the prompt and the first of its 2
    output tokens) past those the index held, the predicted ones (engine blocks are
    chained, so a match is a leading run). When the prediction may have been capped
    by the last-token rule (a prompt of whole engine blocks), its last block may have
    been held already, then recomputed by vLLM, not new."""
    num_prompt, predicted = answer.prompt_tokens, answer.predicted
    most = (num_prompt + 1) // ENGINE_BLOCK - predicted // ENGINE_BLOCK
    is_capped = num_prompt % ENGINE_BLOCK == 0 and predicted == num_prompt - ENGINE_BLOCK
    return most - int(is_capped), most


def route(gw: str, what: str, body: dict[str, Any], is_chat: bool = False) -> Answer:
    """``send`` through the gateway, then wait until the gateway has indexed the blocks
    vLLM stored for it. vLLM publishes a step's events before it answers, but the
    gateway may apply them a few ms after the client has the answer (seen about once in
    30 requests on a loaded 2-core box), and the next request would be routed on an
    index that lacks them. Real clients race so too; this test checks the index."""
    before = {b: row["blocks"] for b, row in kv_rows(gw).items()}
    answer = send(gw, what, body, is_chat)
    fewest, most = (before[answer.backend] + n for n in new_blocks(answer))

    def indexed() -> bool:
        return bool(kv_rows(gw)[answer.backend]["blocks"] >= fewest)

    wait_for(indexed, 10, f"{what}: {answer} indexed ({fewest} blocks)")
    row = kv_rows(gw)[answer.backend]
    assert fewest <= row["blocks"] <= row["max_blocks"] <= most, answer
    return answer


def check(answer: Answer) -> None:
    """vLLM serves exactly the predicted prefix (whole engine blocks)."""
    assert answer.predicted >= 0, f"{answer.what}: no {CACHED_TOKENS_HEADER} header"
    assert answer.predicted % ENGINE_BLOCK == 0, answer
    assert answer.predicted < answer.prompt_tokens, answer
    assert answer.cached == answer.predicted, answer


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass(frozen=True)
class Workload:
    heads: list[str]
    tails: list[str]


def workload(tokenizer_json: Path) -> Workload:
    """Tenants' heads of ``HEAD_TOKENS`` tokens; short tails, one per request."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    rng = random.Random(20251)
    heads = []
    for t in range(NUM_TENANTS):
        target = rng.randint(*HEAD_TOKENS)
        text = f"Tenant {t} handbook."
        while len(tok.encode(text).ids) < target:
            text += " " + _words(rng, 4) + "."
        heads.append(text)
    tails = [f"Question {i}: " + _words(rng, rng.randint(2, 40)) + "?" for i in range(NUM_REQUESTS)]
    return Workload(heads, tails)


def request_body(work: Workload, i: int) -> tuple[dict[str, Any], bool]:
    """Request ``i``: tenant ``i % 5``; odd requests chat, even completions; every fifth
    streamed (with usage)."""
    head, tail = work.heads[i % NUM_TENANTS], work.tails[i]
    is_chat = i % 2 == 1
    if is_chat:
        messages = [{"role": "system", "content": head}, {"role": "user", "content": tail}]
        body: dict[str, Any] = {"messages": messages}
    else:
        body = {"prompt": head + "\n" + tail}
    if i % 5 == 4:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body, is_chat


def kv_rows(gateway_url: str) -> dict[str, dict[str, Any]]:
    """The gateway's KV-event rows as its slowest worker holds them (each worker of
    ``--workers N`` has its own subscriber and index, and the next request may reach
    any of them): ``worker_urls.merged_kv_rows``."""
    urls = gateway_workers(gateway_url)
    return merged_kv_rows([http_json(u + "/admin/config")["kv_events"] for u in urls])


def warm_up(cluster: LocalCluster) -> str:
    """An unrelated request straight to each engine (its first events), then until the
    gateway has applied both streams (both backends ``exact``)."""
    gw = cluster.gateway_url
    assert gw is not None
    for b in cluster.backends:
        send(b.url, f"warm-up {b.name}", {"prompt": f"Warm up {b.name}. " + "ping " * 140})

    def exact() -> bool:
        rows = kv_rows(gw)
        return all(rows[b]["mode"] == "exact" and rows[b]["blocks"] > 0 for b in BACKENDS)

    wait_for(exact, 30, "both backends exact")
    return gw


# --- the tests ---------------------------------------------------------------------------


def test_predicted_cached_prefix_equals_vllms(
    prefix_cluster: LocalCluster, real_env: RealEnv
) -> None:
    gw = warm_up(prefix_cluster)
    rows = kv_rows(gw)
    # the warm-up's 291 tokens fill 2 engine blocks (``blocks`` counts engine blocks)
    assert all(rows[b]["blocks"] == rows[b]["max_blocks"] == WARM_UP_BLOCKS for b in BACKENDS)
    work = workload(Path(real_env.model_dir) / "tokenizer.json")
    answers = []
    for i in range(NUM_REQUESTS):
        body, is_chat = request_body(work, i)
        answer = route(gw, f"request {i}", body, is_chat)
        assert answer.prompt_tokens + 2 <= MAX_MODEL_LEN
        check(answer)
        answers.append(answer)
    # the first request of each (tenant, kind) finds nothing; most later ones go to the
    # backend that holds their head: at least its 4 whole engine blocks
    firsts, later = answers[: 2 * NUM_TENANTS], answers[2 * NUM_TENANTS :]
    assert all(a.cached == 0 for a in firsts), firsts
    hits = [a for a in later if a.cached >= HEAD_TOKENS[0] // ENGINE_BLOCK * ENGINE_BLOCK]
    assert len(hits) >= 0.8 * len(later), [a for a in later if a not in hits]
    rows = kv_rows(gw)
    assert all(rows[b]["mode"] == "exact" and rows[b]["gaps"] == 0 for b in BACKENDS), rows
    assert {a.backend for a in answers} == set(BACKENDS)


def test_prompts_inside_cached_engine_blocks(prefix_cluster: LocalCluster) -> None:
    """Prompts that end inside cached engine blocks (token ids, so lengths are exact):
    vLLM serves whole engine blocks only, and leaves the last token to compute in its
    own blocks. Today's gateway predicts in its 16-token blocks (over by up to 112)."""
    gw = warm_up(prefix_cluster)
    rng = random.Random(7)
    ids = [rng.randrange(300, 2000) for _ in range(5 * ENGINE_BLOCK)]
    first = route(gw, "first", {"prompt": ids})
    assert first.cached == first.predicted == 0
    # (prompt, vLLM's cached tokens, today's prediction): all >= 512 tokens, so the
    # default policy looks at their prefix
    cases = {
        "again (640 tokens, all cached)": (ids, 512, 624),
        "prefix of 620": (ids[:620], 512, 608),
        "prefix of 600": (ids[:600], 512, 592),
        "prefix of 513": (ids[:513], 512, 512),
        "prefix of 512": (ids[:512], 384, 496),
        "prefix of 450, own tail": (ids[:450] + [7] * 80, 384, 448),
    }
    for what, (prompt, cached, today) in cases.items():
        answer = route(gw, what, {"prompt": prompt})
        check(answer)
        assert answer.backend == first.backend, answer
        assert answer.cached == cached, answer
        assert answer.predicted in (cached, today), answer


def test_restarted_vllm_loses_its_entries_and_rebuilds_them(
    prefix_cluster: LocalCluster, real_env: RealEnv
) -> None:
    gw = warm_up(prefix_cluster)
    work = workload(Path(real_env.model_dir) / "tokenizer.json")
    rows = kv_rows(gw)
    victim = max(BACKENDS, key=lambda b: rows[b]["blocks"])
    before = rows[victim]
    assert before["blocks"] > 0 and before["mode"] == "exact"
    index = BACKENDS.index(victim)
    child = prefix_cluster.children[index]
    assert child.proc is not None
    os.killpg(child.proc.pid, signal.SIGKILL)  # API server and engine core at once
    child.proc.wait(timeout=30)

    def dropped() -> bool:
        row = kv_rows(gw)[victim]
        return bool(row["max_blocks"] == 0 and row["mode"] == "approximate")

    wait_for(dropped, 20, f"{victim}'s entries dropped")
    answer = route(gw, "while down", {"prompt": work.heads[0] + "\nStill there?"})
    assert answer.backend != victim
    check(answer)

    child.start()  # the same command line: same port, same ipc paths
    child.wait_healthy(START_TIMEOUT_S)
    url = prefix_cluster.backends[index].url
    fresh = send(url, "fresh", {"prompt": "After the restart. " + "pong " * 140})
    assert fresh.cached == 0  # its cache starts empty

    def rebuilt() -> bool:
        row = kv_rows(gw)[victim]
        return bool(row["mode"] == "exact" and row["blocks"] > 0)

    wait_for(rebuilt, 30, f"{victim} exact again with the new engine's blocks")
    after = kv_rows(gw)[victim]
    assert after["blocks"] == after["max_blocks"] == WARM_UP_BLOCKS, after  # the new engine's
    lost = (after["resyncs"] - before["resyncs"]) + (after["restarts"] - before["restarts"])
    assert lost >= 1, (before, after)
    text = http_text(gw + "/metrics")
    drops = metric_sum(text, "kiloserve_kv_event_resyncs_total", backend=victim)
    drops += metric_sum(text, "kiloserve_kv_event_restarts_total", backend=victim)
    assert drops >= 1
    # routing goes on, and the predictions still match both engines
    for i in range(2 * NUM_TENANTS):
        body, is_chat = request_body(work, i)
        check(route(gw, f"after restart {i}", body, is_chat))
