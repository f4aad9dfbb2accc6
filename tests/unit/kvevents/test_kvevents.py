"""KV events: vLLM's wire format, the exact index, per-backend feeds, and routing."""

from __future__ import annotations

import random

import msgspec
import pytest

from kiloserve.errors import KvEventError
from kiloserve.kvevents.feed import KvEventCache
from kiloserve.kvevents.index import IdentityHasher, KvBlockIndex
from kiloserve.kvevents.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.prefix_index import cached_depths
from kiloserve.tokens import cache_seed, prefix_block_hashes

TOKENS = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16


def stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int = 16, **kw: object
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, **kw)  # type: ignore[arg-type]


def test_round_trip_and_vllm_map_encoding() -> None:
    batch = EventBatch(
        12.5,
        (
            stored([b"h0", b"h1"], None, TOKENS[:32], medium="GPU"),
            BlockRemoved((b"h1",), "GPU"),
            AllBlocksCleared(),
        ),
        0,
    )
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgspec.msgpack.decode(payload)
    # vLLM 0.11+: the batch is an array, each event a map tagged by "type"
    assert raw[0] == 12.5 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_hashes"] == [b"h0", b"h1"]
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_decodes_older_array_tagged_events_and_skips_unknown_types() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockStored", [7, 8], None, TOKENS[:32], 16, None, "GPU"],
                ["BlockRemoved", [8], "GPU"],
                {"type": "SomethingNew", "x": 1},
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (
        stored([7, 8], None, TOKENS[:32], medium="GPU"),
        BlockRemoved((8,), "GPU"),
    )  # type: ignore[list-item]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgspec.msgpack.encode(
            [
                1.0,
                [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [], "block_size": 16}],
            ]
        ),
        msgspec.msgpack.encode([1.0, [42]]),
    ],
)
def test_bad_payloads_raise_kv_event_error(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq(encode_seq(5)) == 5
    assert decode_seq(END_SEQ) == -1
    with pytest.raises(KvEventError):
        decode_seq(b"\x00")


def test_index_rehashes_tokens_the_way_the_gateway_hashes_prompts() -> None:
    index = KvBlockIndex(16)
    index.apply("a", [stored([b"e0", b"e1"], None, TOKENS[:32])])
    index.apply("a", [stored([b"e2"], b"e1", TOKENS[32:48])])
    index.apply("b", [stored([b"x0"], None, TOKENS[:16])])
    prompt = prefix_block_hashes(TOKENS, 16)
    assert index.match_depths(prompt) == {"a": 3, "b": 1}
    assert index.match_depths(prompt, among={"b"}) == {"b": 1}
    assert index.match_depths(prefix_block_hashes([5] * 64, 16)) == {}
    # engine blocks of 32 tokens are two gateway blocks each
    big = KvBlockIndex(16)
    big.apply("c", [stored([b"y0", b"y1"], None, TOKENS[:64], size=32)])
    assert big.match_depths(prompt) == {"c": 4}
    assert KvBlockIndex(32).match_depths(prompt) == {}


def test_index_removals_clears_and_holes() -> None:
    index = KvBlockIndex(16)
    index.apply("a", [stored([b"e0", b"e1", b"e2"], None, TOKENS[:48])])
    prompt = prefix_block_hashes(TOKENS, 16)
    index.apply("a", [BlockRemoved((b"e1",))])
    assert index.match_depths(prompt) == {"a": 1}  # a hole ends the match
    index.apply("a", [AllBlocksCleared()])
    assert index.match_depths(prompt) == {} and index.num_blocks == 0
    assert index.counters.removed == 1 and index.counters.cleared == 1


def test_index_keys_lora_salt_and_multimodal_blocks_apart() -> None:
    index = KvBlockIndex(16)
    index.apply("lora", [stored([b"l0"], None, TOKENS[:16], lora_name="sql")])
    index.apply("salt", [stored([b"s0"], None, TOKENS[:16], extra_keys=(("tenant-1",),))])
    index.apply("image", [stored([b"m0"], None, TOKENS[:16], extra_keys=((("img-hash", 0),),))])
    plain = prefix_block_hashes(TOKENS, 16)
    assert index.match_depths(plain) == {}  # none of them is the base model's plain text
    assert index.match_depths(prefix_block_hashes(TOKENS, 16, cache_seed("sql"))) == {"lora": 1}
    salted = prefix_block_hashes(TOKENS, 16, cache_seed(cache_salt="tenant-1"))
    assert index.match_depths(salted) == {"salt": 1}


def test_index_counts_what_it_cannot_index() -> None:
    index = KvBlockIndex(16, max_blocks_per_backend=2)
    index.apply("a", [stored([b"z1"], b"never-seen", TOKENS[:16])])
    index.apply("a", [stored([b"z2"], None, TOKENS[:24], size=24)])
    index.apply("a", [stored([b"z3"], None, TOKENS[:16], medium="CPU")])
    index.apply("a", [stored([b"o0", b"o1", b"o2"], None, TOKENS[:48])])
    c = index.counters
    assert (c.orphans, c.mismatched, c.other_media, c.overflows) == (1, 1, 1, 1)
    assert index.num_backend_blocks("a") == 0 and index.num_blocks == 0


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, tuple(events))  # type: ignore[arg-type]


def test_feed_orders_batches_detects_gaps_and_restarts() -> None:
    cache = KvEventCache(KvBlockIndex(16))
    feed = cache.feed("a")
    prompt = prefix_block_hashes(TOKENS, 16)
    assert cache.mode("a") == "approximate"
    assert feed.on_batch(0, batch(stored([b"e0"], None, TOKENS[:16]))) == "applied"
    assert cache.mode("a") == "exact" and cache.exact_backends == {"a"}
    late = batch(stored([b"e2"], b"e1", TOKENS[32:48]))
    assert feed.on_batch(2, late) == "gap"  # batch 1 lost: nothing applied
    assert feed.on_replayed(0, batch()) == "duplicate"
    assert feed.on_replayed(1, batch(stored([b"e1"], b"e0", TOKENS[16:32]))) == "applied"
    assert feed.on_batch(2, late) == "applied"
    assert cache.match_depths(tuple(prompt)) == {"a": 3}
    # the engine restarted: numbering starts again, its cache is empty
    assert feed.on_batch(0, batch(stored([b"n0"], None, TOKENS[:16]))) == "restart"
    assert cache.match_depths(tuple(prompt)) == {"a": 1}
    # a replay that cannot reach back: entries dropped, applied from there
    assert feed.on_batch(5, batch()) == "gap"
    assert feed.on_replayed(4, batch(stored([b"q0"], None, TOKENS[:16]))) == "applied"
    assert feed.counters.resyncs == 1 and cache.match_depths(tuple(prompt)) == {"a": 1}
    feed.lost()
    assert cache.mode("a") == "approximate" and cache.match_depths(tuple(prompt)) == {}
    assert (feed.counters.gaps, feed.counters.restarts, feed.counters.losses) == (2, 1, 1)
    cache.remove("a")
    assert cache.feeds() == []


def state(bid: str, **kw: object) -> BackendState:
    base: dict[str, object] = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.1}
    return BackendState(backend_id=bid, models=frozenset({"m"}), **(base | kw))  # type: ignore[arg-type]


def request(tokens: list[int]) -> RequestInfo:
    return RequestInfo("r", "m", len(tokens), 16, prefix_hashes=tuple(prefix_block_hashes(tokens)))


@pytest.mark.parametrize("policy_name", ["default", "prefix_affinity"])
def test_policies_route_on_the_engines_cache_for_exact_backends(policy_name: str) -> None:
    """The engines' events say b holds the prompt, though this gateway sent it to a
    (the approximate index says a): exact backends use the events, others the guess."""
    tokens = [7 + i % 50 for i in range(1024)]
    policy = create_policy(policy_name)
    policy.on_dispatch(request(tokens), "a")
    cache = KvEventCache(KvBlockIndex(16))
    snapshot = ClusterSnapshot(0.0, (state("a"), state("b"), state("c")), kv_cache=cache)
    rng = random.Random(0)
    assert policy.choose(request(tokens), snapshot, rng).ranked[0] == "a"  # no events yet
    cache.feed("a").on_batch(0, batch())  # a publishes, holds nothing: exact says 0
    cache.feed("b").on_batch(0, batch(stored([b"b0", b"b1"], None, tokens[:32])))
    assert policy.choose(request(tokens), snapshot, rng).ranked[0] == "b"
    cache.feed("b").lost()  # b's stream is gone; a's events say it holds nothing
    assert cached_depths(policy.index, snapshot, request(tokens).prefix_hashes) == {}
    cache.feed("a").lost()  # both approximate: back to what this gateway sent where
    assert cached_depths(policy.index, snapshot, request(tokens).prefix_hashes) == {"a": 64}


def test_identity_hasher_takes_engine_hashes_as_local_hashes() -> None:
    index = KvBlockIndex(16, IdentityHasher())
    hashes = prefix_block_hashes(TOKENS, 16)
    index.apply("s", [BlockStored(tuple(hashes[:3]), None, (), 16)])
    assert index.match_depths(hashes) == {"s": 3}


def test_exact_depths_are_what_each_engine_can_serve() -> None:
    """An engine serves whole blocks of its own size, and computes at least the last
    prompt token (issue 14: vLLM's 128-token CPU blocks against the gateway's 16)."""
    cache = KvEventCache(KvBlockIndex(16))
    cache.feed("big").on_batch(0, batch(stored([b"g0", b"g1"], None, TOKENS[:64], size=32)))
    cache.feed("small").on_batch(0, batch(stored([b"s0", b"s1"], None, TOKENS[:32])))
    partial = tuple(prefix_block_hashes(TOKENS[:48] + [1] * 52))  # 3 blocks, then others
    assert cache.match_depths(partial) == {"big": 2, "small": 2}  # half an engine block: 0
    whole = tuple(prefix_block_hashes(TOKENS[:64]))
    assert cache.match_depths(whole) == {"big": 4, "small": 2}
    # a 64-token prompt: the last token is computed, so only 63 tokens can hit
    assert cache.match_depths(whole, num_tokens=64) == {"big": 2, "small": 2}
    assert cache.match_depths(whole, num_tokens=65) == {"big": 4, "small": 2}
