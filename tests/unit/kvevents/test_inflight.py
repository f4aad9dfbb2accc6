"""Prompts in flight count as held on exact backends before their events arrive."""

from __future__ import annotations

import random

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.kvevents.feed import KvEventCache
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.inflight import InFlightPrefixes
from kiloserve.policies import RequestInfo, create_policy
from kiloserve.policies.base import Decision
from kiloserve.routing.router import Router
from kiloserve.routing.table import BackendTable
from kiloserve.tokens import prefix_block_hashes

SYSTEM = [3 + i % 97 for i in range(2048)]  # a tenant's 2,048-token system prompt


def test_common_prefix_per_backend_capped_and_removed() -> None:
    flight = InFlightPrefixes(max_per_backend=2)
    a, b = (1, 2, 3, 4), (1, 2, 9)
    flight.add("x", a)
    flight.add("y", b)
    assert flight.match_depths((1, 2, 3, 7), {"x", "y"}) == {"x": 3, "y": 2}
    assert flight.match_depths((1, 2, 3, 7), {"y"}) == {"y": 2}  # exact backends only
    assert flight.match_depths((5, 2), {"x", "y"}) == {}
    flight.add("x", (1, 8))
    flight.add("x", (1, 2, 3, 4, 5))  # the oldest of x's three is forgotten
    assert flight.num_requests == 3
    flight.remove("x", a)  # already forgotten: ignored
    assert flight.match_depths((1, 2, 3, 4, 5), {"x"}) == {"x": 5}
    flight.remove("x", (1, 2, 3, 4, 5))
    flight.remove("x", (1, 8))
    flight.forget_backend("y")
    assert flight.num_requests == 0 and flight.match_depths((1, 2), {"x", "y"}) == {}


def _plain_common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_floors_keep_only_the_backends_whose_requests_share_more() -> None:
    """Random chained prompts (a tree of shared prefixes): with floors, a backend is
    listed exactly when one of its requests shares more than its floor, at that depth;
    without, every backend holding the first block, as the plain definition says."""
    rng = random.Random(7)
    for _ in range(200):
        trunks = [tuple(range(1, 1 + rng.randrange(1, 12)))]  # block i's hash: i + 1
        flight, held = InFlightPrefixes(max_per_backend=4), {}
        for backend in "abcdef":
            for _ in range(rng.randrange(0, 4)):
                trunk = rng.choice(trunks)
                cut = rng.randrange(1, len(trunk) + 1)
                tail = tuple(rng.randrange(100, 10**9) for _ in range(rng.randrange(0, 6)))
                hashes = trunk[:cut] + tail
                trunks.append(hashes)
                flight.add(backend, hashes)
                held.setdefault(backend, []).append(hashes)
        query = rng.choice(trunks)[: rng.randrange(1, 16)]
        backends = set("abcdf")
        plain = {
            b: max(_plain_common(query, h) for h in hs) for b, hs in held.items() if b in backends
        }
        plain = {b: d for b, d in plain.items() if d > 0}
        assert flight.match_depths(query, backends) == plain
        floors = {b: rng.randrange(0, 8) for b in "abcdef" if rng.random() < 0.7}
        expected = {b: d for b, d in plain.items() if d > floors.get(b, 0)}
        assert flight.match_depths(query, backends, floors) == expected


def _router() -> tuple[Router, KvEventCache]:
    backends = [
        {"url": f"http://127.0.0.1:90{i}", "name": f"b{i}", "models": ["m"]} for i in range(4)
    ]
    cfg = parse_gateway_config({"backends": backends})
    table = BackendTable(cfg)
    cache = table.kv_cache = KvEventCache(KvBlockIndex(block_size=16))
    for i in range(4):
        cache.mode_changed(f"b{i}", "exact")  # every stream in order, nothing stored yet
    return Router(table, create_policy("default"), random.Random(0)), cache


def _request(rid: str, tail: int) -> RequestInfo:
    tokens = SYSTEM + [200 + tail] * 40
    hashes = tuple(prefix_block_hashes(tokens))
    return RequestInfo(rid, "m", len(tokens), 32, prefix_hashes=hashes)


def _send(router: Router, info: RequestInfo) -> tuple[Decision, RequestInfo]:
    decision = router.decide(info, 0.0)
    attempt = router.attempt_info(info, decision.cached_blocks, decision.ranked[0])
    router.dispatch(decision.ranked[0], attempt)
    return decision, attempt


def test_a_burst_sharing_a_new_prefix_follows_the_first_request() -> None:
    """Found (issue 14): with every backend exact, the index knows a prompt only once
    its engine's events arrive; a tenant's second request sent while the first still
    prefills was routed as if nothing were cached (by load: away from the first)."""
    router, cache = _router()
    first, first_attempt = _send(router, _request("r1", 1))
    holder = first.ranked[0]
    second, _ = _send(router, _request("r2", 2))
    assert second.ranked[0] == holder
    assert second.cached_blocks is not None and second.cached_blocks[holder] == 2048 // 16
    # the first ends: its blocks are no longer pinned, only events can say they stay
    router.complete(holder, first_attempt, ok=True, status=200, started_s=0.0,
                    first_token_s=0.1, last_token_s=0.2, output_tokens=32)  # fmt: skip
    assert cache.in_flight.num_requests == 1
