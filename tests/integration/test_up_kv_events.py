"""``kiloserve up`` with ``kv_events_endpoint: auto``: each twin replica binds its own
addresses, and the gateway config the launcher writes names them (real processes)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
import zmq

from kiloserve.kvevents.wire import END_SEQ, BlockStored, decode_batch, decode_seq, encode_seq
from kiloserve.launch.cluster import LocalCluster
from kiloserve.launch.config import parse_cluster_config
from kiloserve.routing.config import BackendConfig
from kiloserve.tokens import block_hashes, filler_text, tokenize

CLUSTER = {
    "backends": [
        {
            "name": "h100",
            "gpu": "H100",
            "model": "llama-3.1-8b",
            "count": 2,
            "kv_events_endpoint": "auto",
            "kv_events_replay_endpoint": "auto",
        },
        {"name": "a100", "gpu": "A100", "model": "llama-3.1-8b"},
    ]
}
PROMPT = filler_text(40, seed=3)  # two full 16-token blocks


def _subscribe(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    monitor.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    monitor.recv_multipart()  # connected; the subscription follows at once
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.1)  # the subscription travels right after the handshake
    return sub


def _complete(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


@pytest.mark.timeout(120)
def test_auto_gives_each_replica_its_own_endpoints_in_the_gateway_config(
    tmp_path: Path,
) -> None:
    cfg = parse_cluster_config(CLUSTER)
    with LocalCluster(cfg, gateway=True, gateway_port=0, run_dir=tmp_path) as cluster:
        written = yaml.safe_load((tmp_path / "gateway.yaml").read_text())["backends"]
        by_name = {b["name"]: b for b in written}
        assert set(by_name) == {"h100-0", "h100-1", "a100"}
        assert "kv_events_endpoint" not in by_name["a100"]
        addresses = [
            by_name[name][key]
            for name in ("h100-0", "h100-1")
            for key in ("kv_events_endpoint", "kv_events_replay_endpoint")
        ]
        assert len(set(addresses)) == 4
        assert all(a.startswith("tcp://127.0.0.1:") for a in addresses)
        for entry in written:
            BackendConfig.model_validate(entry)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            for name in ("h100-0", "h100-1"):
                entry = by_name[name]
                log = cluster.log_path(name).read_text()
                assert f"KV events published on {entry['kv_events_endpoint']}" in log
                sub = _subscribe(ctx, entry["kv_events_endpoint"])
                _complete(entry["url"], entry["models"][0])
                topic, seq, payload = sub.recv_multipart()
                stored = decode_batch(payload).events[0]
                assert isinstance(stored, BlockStored)
                assert stored.block_hashes == tuple(block_hashes(tokenize(PROMPT), 16))
                assert decode_seq(seq) == 0  # each replica numbers its own batches
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.RCVTIMEO, 10_000)
                dealer.connect(entry["kv_events_replay_endpoint"])
                dealer.send_multipart([b"", encode_seq(0)])
                assert dealer.recv_multipart() == [b"", topic, seq, payload]
                assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
                dealer.close(linger=0)
                sub.close(linger=0)
        finally:
            ctx.destroy(linger=0)
