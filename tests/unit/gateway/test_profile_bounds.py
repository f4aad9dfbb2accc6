"""The profiler's per-user state is bounded in entries and in bytes, whatever ``user`` is.

Issue 15: 150 requests with a unique 2 MB ``user`` took the gateway from 52 to 357 MB,
never released (the output predictor keyed its LRU on the raw string). Long keys are
now hashed (stable, so one user keeps its session / tenant / history) and token-id
prompts are validated (an id outside 0..2^32-1 was a 500 from ``block_hashes``).
"""

from __future__ import annotations

import base64
import gc
import tracemalloc

import orjson
import pytest

from kiloserve.errors import RequestError
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.profile import MAX_KEY_CHARS, Profiler

_MB = 1 << 20
_BASE = "u" * (2 * _MB)  # one 2 MB string; each user adds a suffix to it


def _profiler() -> Profiler:
    return Profiler(parse_gateway_config({}))


def _jwt(sub: str) -> str:
    payload = base64.urlsafe_b64encode(orjson.dumps({"sub": sub})).rstrip(b"=").decode()
    return f"Bearer eyJhbGciOiJub25lIn0.{payload}.sig"


def _retained(start: int) -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - start


@pytest.mark.slow  # ~40 s on a 2-core box: hashing 2 x 10,000 x 2 MB is the cost
@pytest.mark.timeout(300)
def test_10k_distinct_2mb_users_retain_a_few_mb_at_most() -> None:
    prof = _profiler()
    tracemalloc.start()
    try:
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            user = _BASE + str(i)
            info = prof.profile(f"r{i}", {"model": "m", "prompt": "hi", "user": user}, {})
            prof.outputs.observe(user, "m", 10 + i % 7)  # what the proxy does at the end
            del user, info
            if i % 500 == 499:  # fail early (and cheaply) when the state keeps the strings
                assert _retained(start) < 4 * _MB, f"after {i + 1} users"
        assert _retained(start) < 4 * _MB
    finally:
        tracemalloc.stop()


def test_long_keys_are_hashed_stable_and_distinct() -> None:
    prof = _profiler()
    a1, a2, b = _BASE + "a", "".join([_BASE, "a"]), _BASE + "b"  # a1 == a2, not the same object
    assert a1 == a2 and a1 is not a2
    ia = prof.profile("r1", {"model": "m", "prompt": "x", "user": a1}, {})
    ia2 = prof.profile("r2", {"model": "m", "prompt": "x", "user": a2}, {})
    ib = prof.profile("r3", {"model": "m", "prompt": "x", "user": b}, {})
    assert ia.session_key == ia2.session_key == ia.tenant == ia2.tenant
    assert ia.session_key != ib.session_key  # same 2 MB prefix, different users
    for key in (ia.session_key, ib.session_key):
        assert key is not None and len(key) <= 2 * MAX_KEY_CHARS
    # the predictor learns per long user too, and tells them apart
    prof.outputs.observe(a1, "m", 40)
    prof.outputs.observe(b, "m", 90)
    assert prof.outputs.predict(a2, "m") == 40
    assert prof.outputs.predict(b, "m") == 90
    # the x-session-id header and a JWT subject are bounded the same way
    long_sid = "s" * 8000
    by_header = prof.profile("r4", {"model": "m", "prompt": "x"}, {"x-session-id": long_sid})
    by_jwt = prof.profile("r5", {"model": "m", "prompt": "x"}, {"authorization": _jwt(long_sid)})
    assert by_header.session_key == by_jwt.session_key
    assert by_header.session_key is not None and len(by_header.session_key) <= 2 * MAX_KEY_CHARS


def test_short_users_are_kept_as_they_are_and_learned_per_user() -> None:
    prof = _profiler()
    short = "x" * MAX_KEY_CHARS
    info = prof.profile("r", {"model": "m", "prompt": "x", "user": short}, {})
    assert info.session_key == info.tenant == short
    for _ in range(20):
        prof.outputs.observe("alice", "m", 50)
        prof.outputs.observe("bob", "m", 500)
    alice = prof.profile("r", {"model": "m", "prompt": "x", "user": "alice"}, {})
    bob = prof.profile("r", {"model": "m", "prompt": "x", "user": "bob"}, {})
    assert (alice.predicted_output_tokens, bob.predicted_output_tokens) == (50, 500)
    assert prof.profile("r", {"model": "m", "prompt": "x"}, {}).predicted_output_tokens == 256


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2**32],
        [-1, 5],
        [True, 1],
        [1, 2.5],
        [1, "a"],
        [1, [2]],
        [[1, 2], [3, 2**40]],
        [[1, False]],
        [[[1, 2]]],
        [[1, [2]], [3]],
    ],
    ids=repr,
)
def test_bad_token_id_prompts_are_400_naming_prompt(prompt: list[object]) -> None:
    with pytest.raises(RequestError) as info:
        _profiler().profile("r", {"model": "m", "prompt": prompt * 20}, {})
    assert info.value.status == 400 and info.value.param == "prompt"
    assert info.value.err_type == "invalid_request_error"


def test_good_token_id_prompts_still_count_exactly() -> None:
    prof = _profiler()
    edge = [0, 2**32 - 1] * 20
    assert prof.profile("r", {"model": "m", "prompt": edge}, {}).input_tokens == 40
    batch = [[1, 2] * 10, [3] * 20]
    assert prof.profile("r", {"model": "m", "prompt": batch}, {}).input_tokens == 40
