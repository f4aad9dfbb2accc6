"""The twin publishes vLLM's KV-cache event stream over real ZMQ sockets on 127.0.0.1.

A SUB socket in the test reads the twin's PUB socket, a DEALER its replay ROUTER;
every batch is decoded with ``kvevents.wire`` and checked against the twin's own
tokenisation (``kiloserve.tokens``) and engine hashes (``tokens.block_hashes``: the
block manager's chained hash). The twin's cache is tiny (``num_gpu_blocks_override``
12: 11 blocks of 16 tokens) so a third 80-token prompt evicts the first one's blocks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from conftest import FixedStepTimer, free_port
from kiloserve.engine.server import TwinServer
from kiloserve.engine.twin import TwinConfig
from kiloserve.errors import ConfigError
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.wire import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
    encode_seq,
)
from kiloserve.tokens import block_hashes, filler_text, prefix_block_hashes, tokenize

BS = 16  # the twin's block size (vLLM's on CUDA)
PROMPT_A = filler_text(40, seed=1)  # 40 tokens: 2 full blocks
PROMPT_B = PROMPT_A + " " + filler_text(30, seed=2)  # shares A's 2 blocks, 4 in all


def _config(**kwargs: Any) -> TwinConfig:
    base: dict[str, Any] = {
        "gpu": "H100",
        "model": "llama-3.1-8b",
        "port": 0,
        "api_overhead_s": 0.0,
        "num_gpu_blocks_override": 12,
        "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    base.update(kwargs)
    return TwinConfig(**base)


@pytest.fixture
async def twin() -> AsyncIterator[TwinServer]:
    async with TwinServer(_config(), timer=FixedStepTimer(0.002)) as server:
        yield server


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _subscribe(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """A SUB socket connected to ``endpoint``, returned once its handshake is done."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    try:
        await asyncio.wait_for(monitor.recv_multipart(), 5)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    await asyncio.sleep(0.1)  # the subscription itself travels after the handshake
    return sub


async def _recv(sub: zmq.asyncio.Socket, timeout_s: float = 5.0) -> tuple[int, EventBatch]:
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), timeout_s)
    assert topic == b""
    return decode_seq(seq), decode_batch(payload)


async def _complete(url: str, prompt: str, max_tokens: int = 1) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def _recv_until_quiet(sub: zmq.asyncio.Socket) -> list[tuple[int, EventBatch]]:
    """Every batch that arrives until none has for 0.3 s."""
    out: list[tuple[int, EventBatch]] = []
    while True:
        try:
            out.append(await _recv(sub, 0.3))
        except TimeoutError:
            return out


def _stored(batches: list[tuple[int, EventBatch]]) -> list[BlockStored]:
    return [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]


def _removed(batches: list[tuple[int, EventBatch]]) -> list[int | bytes]:
    return [
        h
        for _, b in batches
        for e in b.events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]


async def test_stored_blocks_carry_the_twins_tokens_and_hashes(
    twin: TwinServer, ctx: zmq.asyncio.Context
) -> None:
    publisher = twin.twin.kv_publisher
    assert publisher is not None and publisher.endpoint is not None
    sub = await _subscribe(ctx, publisher.endpoint)
    before_s = time.time()
    await _complete(twin.url, PROMPT_A)
    seq_a, batch_a = await _recv(sub)
    await _complete(twin.url, PROMPT_B)
    seq_b, batch_b = await _recv(sub)
    ids_a, ids_b = tokenize(PROMPT_A), tokenize(PROMPT_B)
    hashes_b = block_hashes(ids_b, BS)
    assert ids_b[:32] == ids_a[:32] and len(hashes_b) == 4
    assert (seq_a, seq_b) == (0, 1)
    assert batch_a.data_parallel_rank == 0
    assert before_s <= batch_a.ts <= batch_b.ts <= time.time()
    assert batch_a.events == (
        BlockStored(tuple(hashes_b[:2]), None, tuple(ids_a[:32]), BS, medium="GPU"),
    )
    # B hits A's two blocks: only its own two are new, chained from A's last one
    assert batch_b.events == (
        BlockStored(tuple(hashes_b[2:]), hashes_b[1], tuple(ids_b[32:64]), BS, medium="GPU"),
    )
    index = KvBlockIndex(block_size=BS)
    index.apply("twin", batch_a.events + batch_b.events)
    assert index.match_depths(prefix_block_hashes(ids_b, BS)) == {"twin": 4}
    sub.close(linger=0)


async def test_eviction_is_published_and_sequence_numbers_run_from_zero(
    twin: TwinServer, ctx: zmq.asyncio.Context
) -> None:
    publisher = twin.twin.kv_publisher
    assert publisher is not None and publisher.endpoint is not None
    sub = await _subscribe(ctx, publisher.endpoint)
    prompts = [filler_text(80, seed=10 + i) for i in range(3)]  # 5 blocks each, 11 in all
    for prompt in prompts:
        await _complete(twin.url, prompt)
    batches = await _recv_until_quiet(sub)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    stored = _stored(batches)
    first = block_hashes(tokenize(prompts[0]), BS)
    assert [e.block_hashes for e in stored] == [
        tuple(block_hashes(tokenize(p), BS)) for p in prompts
    ]
    removed = _removed(batches)
    assert removed and set(removed) <= set(first)  # LRU: the first prompt goes first
    index = KvBlockIndex(block_size=BS)
    for _, batch in batches:
        index.apply("twin", batch.events)
    depths = [
        index.match_depths(prefix_block_hashes(tokenize(p), BS)).get("twin", 0) for p in prompts
    ]
    assert depths[0] == 5 - len(removed) < 5 and depths[2] == 5
    sub.close(linger=0)


async def test_replay_returns_missed_batches_then_end_seq(
    twin: TwinServer, ctx: zmq.asyncio.Context
) -> None:
    publisher = twin.twin.kv_publisher
    assert publisher is not None and publisher.replay_endpoint is not None
    prompts = [filler_text(40, seed=20 + i) for i in range(3)]
    sub = await _subscribe(ctx, publisher.endpoint or "")
    await _complete(twin.url, prompts[0])
    seq, live = await _recv(sub)
    sub.close(linger=0)  # the subscriber goes away: it misses the next two batches
    for prompt in prompts[1:]:
        await _complete(twin.url, prompt)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    await dealer.send_multipart([b"", encode_seq(seq + 1)])
    frames = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(3)]
    assert [f[:2] for f in frames[:2]] == [[b"", b""], [b"", b""]]
    assert [decode_seq(f[2]) for f in frames[:2]] == [1, 2]
    replayed = [decode_batch(f[3]) for f in frames[:2]]
    assert [[e.block_hashes for e in b.events] for b in replayed] == [
        [tuple(block_hashes(tokenize(p), BS))] for p in prompts[1:]
    ]
    assert frames[2] == [b"", b"", END_SEQ, b""]
    await dealer.send_multipart([b"", encode_seq(0)])  # the whole buffer, live one too
    frames = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(4)]
    assert decode_batch(frames[0][3]) == live and frames[3][2] == END_SEQ
    await dealer.send_multipart([b"", encode_seq(99)])  # nothing that new: END_SEQ only
    assert await asyncio.wait_for(dealer.recv_multipart(), 5) == [b"", b"", END_SEQ, b""]
    assert publisher.num_replays == 3
    dealer.close(linger=0)


async def test_busy_endpoint_and_replay_alone_are_config_errors() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        server = TwinServer(_config(kv_events_endpoint=endpoint))
        with pytest.raises(ConfigError, match="cannot bind the KV events socket"):
            await server.start()
    with pytest.raises(ConfigError, match="--kv-events-replay-endpoint needs"):
        TwinServer(_config(kv_events_endpoint=None))


def test_cli_binds_port_zero_logs_the_endpoints_and_publishes() -> None:
    cmd = [sys.executable, "-m", "kiloserve", "engine", "--gpu", "H100", "--model"]
    cmd += ["llama-3.1-8b", "--port", "0", "--num-gpu-blocks-override", "64"]
    cmd += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
    cmd += ["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 20
        while not any("KV events published on" in x for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stderr.readline().decode())
        url = next(x for x in lines if "listening on " in x).rsplit("listening on ", 1)[1]
        words = lines[-1].replace(",", "").split()
        endpoint, replay = words[words.index("on") + 1], words[-1]
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        assert replay.startswith("tcp://127.0.0.1:") and replay != endpoint
        asyncio.run(_one_request_seen(url.strip(), endpoint))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.communicate()
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


async def _one_request_seen(url: str, endpoint: str) -> None:
    context = zmq.asyncio.Context()
    try:
        sub = await _subscribe(context, endpoint)
        await _complete(url, PROMPT_A)
        seq, batch = await _recv(sub)
        assert seq == 0
        assert batch.events[0] == BlockStored(
            tuple(block_hashes(tokenize(PROMPT_A), BS)),
            None,
            tuple(tokenize(PROMPT_A)[:32]),
            BS,
            medium="GPU",
        )
    finally:
        context.destroy(linger=0)


def test_twin_without_endpoints_does_not_import_zmq() -> None:
    code = (
        "import sys\n"
        "from kiloserve.engine.twin import TwinConfig, build_twin\n"
        "twin = build_twin(TwinConfig(gpu='H100', model='llama-3.1-8b', port=0))\n"
        "assert twin.kv_publisher is None\n"
        "print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "[]"
