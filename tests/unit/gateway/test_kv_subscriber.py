"""The KV-event subscriber's frame parsing (both vLLM replay layouts) and the KV metrics.

The sockets, gaps, replays, restarts and the backend lifecycle are end to end in
``tests/integration/test_gateway_kv_events.py``.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiloserve.errors import KvEventError
from kiloserve.gateway.app import METRICS_KEY, create_gateway_app
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.kvevents import parse_live, parse_replay
from kiloserve.gateway.metrics import GatewayMetrics
from kiloserve.gateway.profile import Profiler
from kiloserve.kvevents.feed import KvEventCache
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.wire import END_SEQ, BlockStored, EventBatch, encode_batch, encode_seq
from kiloserve.routing.table import BackendTable

STORED = BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=tuple(range(4)),
                     block_size=4)  # fmt: skip
BATCH = EventBatch(1.5, (STORED,))
PAYLOAD = encode_batch(BATCH)


def test_parse_live_reads_topic_seq_payload() -> None:
    assert parse_live([b"kv", encode_seq(41), PAYLOAD]) == (41, BATCH)
    assert parse_live([b"", encode_seq(0), PAYLOAD]) == (0, BATCH)


@pytest.mark.parametrize(
    "frames",
    [
        [encode_seq(1), PAYLOAD],  # no topic frame
        [b"kv", encode_seq(1), PAYLOAD, b"extra"],
        [b"kv", b"\x01", PAYLOAD],  # seq is 8 bytes
        [b"kv", encode_seq(1), b"\xc1"],  # not msgpack
        [b"kv", encode_seq(1), b"\x92\x01\x02"],  # [1, 2]: not a batch
    ],
)
def test_parse_live_refuses_what_is_not_vllm_format(frames: list[bytes]) -> None:
    with pytest.raises(KvEventError):
        parse_live(frames)


def test_parse_replay_reads_both_vllm_layouts() -> None:
    # vLLM >= 0.11: (b"", topic, seq, payload) ... (b"", b"", END_SEQ, b"")
    assert parse_replay([b"", b"kv", encode_seq(3), PAYLOAD]) == (3, BATCH)
    assert parse_replay([b"", b"", END_SEQ, b""]) is None
    # older vLLM and SGLang: (b"", seq, payload) ... (b"", END_SEQ, b"")
    assert parse_replay([b"", encode_seq(3), PAYLOAD]) == (3, BATCH)
    assert parse_replay([b"", END_SEQ, b""]) is None
    assert parse_replay([b"", b""]) is None  # the oldest bare end marker


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"kv", encode_seq(3), PAYLOAD, b"extra"],
        [b"", b"kv", b"\x00", PAYLOAD],
        [b"", b"kv", encode_seq(3), b"garbage"],
    ],
)
def test_parse_replay_refuses_malformed_answers(frames: list[bytes]) -> None:
    with pytest.raises(KvEventError):
        parse_replay(frames)


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(("kiloserve_kv_", "kiloserve_tokenizer_"))
    }


def _table() -> BackendTable:
    cfg = parse_gateway_config({"backends": [
        {"url": "http://127.0.0.1:9", "name": "b", "kv_events_endpoint": "tcp://127.0.0.1:5557"},
        {"url": "http://127.0.0.1:10", "name": "c"},
    ]})  # fmt: skip
    return BackendTable(cfg)


def test_kv_metrics_without_a_cache_say_approximate_and_nothing_else() -> None:
    samples = _samples(GatewayMetrics(_table()))
    assert samples == {
        ("kiloserve_kv_index_mode", (("backend", "b"), ("mode", "exact"))): 0.0,
        ("kiloserve_kv_index_mode", (("backend", "b"), ("mode", "approximate"))): 1.0,
        ("kiloserve_kv_index_mode", (("backend", "c"), ("mode", "exact"))): 0.0,
        ("kiloserve_kv_index_mode", (("backend", "c"), ("mode", "approximate"))): 1.0,
        ("kiloserve_kv_index_blocks", ()): 0.0,
    }


def test_kv_metrics_read_the_feeds_the_index_and_the_tokenizer_modes() -> None:
    table = _table()
    metrics = GatewayMetrics(table)
    cache = table.kv_cache = KvEventCache(KvBlockIndex(block_size=4))
    feed = cache.feed("b")
    feed.on_batch(0, BATCH)
    assert feed.on_batch(5, BATCH) == "gap"
    feed.lost()  # the gap could not be closed: a resync
    feed.on_batch(5, BATCH)
    feed.on_batch(0, EventBatch(2.0, ()))  # the publisher restarted
    metrics.kv_bad_message("b")
    metrics.kv_bad_message("b")
    metrics.tokenizer_modes = lambda: {"m": "exact", "n": "approximate", "o": "other"}
    samples = _samples(metrics)
    b = (("backend", "b"),)
    assert samples[("kiloserve_kv_events_total", b)] == 2
    assert samples[("kiloserve_kv_event_batches_total", b)] == 3
    assert samples[("kiloserve_kv_event_gaps_total", b)] == 1
    assert samples[("kiloserve_kv_event_resyncs_total", b)] == 1
    assert samples[("kiloserve_kv_event_restarts_total", b)] == 1
    assert samples[("kiloserve_kv_event_bad_messages_total", b)] == 2
    assert samples[("kiloserve_kv_index_blocks", ())] == 0  # the restart's batch is empty
    assert samples[("kiloserve_kv_index_mode", (*b, ("mode", "exact")))] == 1
    assert samples[("kiloserve_kv_index_mode", (("backend", "c"), ("mode", "exact")))] == 0
    modes = {k[1]: v for k, v in samples.items() if k[0] == "kiloserve_tokenizer_mode"}
    assert modes == {
        (("mode", "exact"), ("model", "m")): 1.0,
        (("mode", "approximate"), ("model", "m")): 0.0,
        (("mode", "exact"), ("model", "n")): 0.0,
        (("mode", "approximate"), ("model", "n")): 1.0,
        (("mode", "exact"), ("model", "o")): 0.0,
        (("mode", "approximate"), ("model", "o")): 0.0,
        (("mode", "other"), ("model", "o")): 1.0,
    }


def test_kv_index_blocks_counts_distinct_blocks() -> None:
    table = _table()
    metrics = GatewayMetrics(table)
    cache = table.kv_cache = KvEventCache(KvBlockIndex(block_size=4))
    cache.feed("b").on_batch(0, BATCH)
    cache.feed("c").on_batch(0, BATCH)  # the same block on a second backend
    assert _samples(metrics)[("kiloserve_kv_index_blocks", ())] == 1


def test_tokenizer_modes_fall_back_to_none_on_a_profiler_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(Profiler, "tokenizer_modes", raising=False)
    app = create_gateway_app(parse_gateway_config({"policy": {"name": "round_robin"}}))
    assert dict(app[METRICS_KEY].tokenizer_modes()) == {}
    monkeypatch.setattr(Profiler, "tokenizer_modes", lambda self: {"m": "exact"}, raising=False)
    app = create_gateway_app(parse_gateway_config({"policy": {"name": "round_robin"}}))
    assert dict(app[METRICS_KEY].tokenizer_modes()) == {"m": "exact"}
