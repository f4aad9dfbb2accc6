"""A real vLLM (CPU build) started by ``kiloserve up`` with ``kv_events_endpoint: auto``
publishes KV events on the ipc sockets the launcher chose, in the format
``kiloserve.kvevents.wire`` decodes, and the gateway's index re-hashes them into the
prompt's blocks."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
import zmq

from conftest import START_TIMEOUT_S, RealEnv, vllm_backend
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.wire import END_SEQ, BlockStored, decode_batch, decode_seq, encode_seq
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config
from kiloserve.tokens import filler_text, prefix_block_hashes

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = filler_text(300, seed=5)  # > 2 of vLLM's 128-token CPU blocks


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_vllm_kv_events_reach_a_subscriber(
    real_env: RealEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    line = vllm_backend("vllm-kv", real_env, 0)
    line |= {"kv_events_endpoint": "auto", "kv_events_replay_endpoint": "auto"}
    cfg = parse_cluster_config({"name": "real-kv", "backends": [line]})
    run_dir = tmp_path_factory.mktemp("kv")  # short: vLLM's own ipc paths go under it
    with LocalCluster(cfg, gateway=False, run_dir=run_dir, start_timeout_s=START_TIMEOUT_S) as c:
        info = c.backends[0]
        assert (
            info.kv_events_endpoint == f"ipc://{run_dir.resolve()}/scratch/vllm-kv/kv/events.sock"
        )
        assert info.kv_events_replay_endpoint is not None
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 60_000)
            sub.connect(info.kv_events_endpoint)
            time.sleep(0.5)  # ipc connects at once; the subscription follows
            _post(
                info.url + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
            )
            tokens = _post(info.url + "/tokenize", {"model": "tiny", "prompt": PROMPT})["tokens"]
            topic, seq, payload = sub.recv_multipart()
            stored = [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
            assert decode_seq(seq) == 0 and stored
            event = stored[0]
            num_tokens = len(event.block_hashes) * event.block_size
            assert event.parent_block_hash is None and num_tokens >= event.block_size
            assert event.token_ids == tuple(tokens[:num_tokens])
            index = KvBlockIndex(block_size=16)
            index.apply("vllm", stored)
            depth = index.match_depths(prefix_block_hashes(tokens, 16))
            assert depth == {"vllm": num_tokens // 16}
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVTIMEO, 30_000)
            dealer.connect(info.kv_events_replay_endpoint)
            dealer.send_multipart([b"", encode_seq(0)])
            assert dealer.recv_multipart() == [b"", topic, seq, payload]
            frames = dealer.recv_multipart()
            while frames[2] != END_SEQ:  # any later batches, then the end marker
                frames = dealer.recv_multipart()
            assert frames == [b"", b"", END_SEQ, b""]
        finally:
            ctx.destroy(linger=0)
