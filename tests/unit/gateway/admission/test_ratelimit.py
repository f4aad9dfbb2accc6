"""Token buckets and the in-process limiter, with a fake clock."""

from __future__ import annotations

import pytest

from kiloserve.errors import retry_after_header
from kiloserve.gateway.admission.ratelimit import LocalLimiter, Quota, TokenBucket


def test_bucket_refills_continuously_up_to_capacity() -> None:
    b = TokenBucket.per_minute(60.0, now_s=0.0)  # 1 per second
    b.adjust(-60.0)
    b.refill(10.0)
    assert b.level == pytest.approx(10.0)
    b.refill(1000.0)
    assert b.level == pytest.approx(60.0)
    assert b.wait_s(70.0) == 0.0  # capped at capacity: a huge request can still go when full


def test_requests_per_minute() -> None:
    lim = LocalLimiter()
    q = Quota("k", max_requests_per_min=3, max_tokens_per_min=None)
    assert [lim.acquire_now(q, 0, 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = lim.acquire_now(q, 0, 0.0)
    assert wait == pytest.approx(20.0)  # one request per 20 s
    assert lim.acquire_now(q, 0, 19.0) > 0.0
    assert lim.acquire_now(q, 0, 20.0) == 0.0
    assert retry_after_header(wait) == "20"


def test_tokens_per_minute_all_or_nothing() -> None:
    lim = LocalLimiter()
    q = Quota("k", max_requests_per_min=100, max_tokens_per_min=1000)
    assert lim.acquire_now(q, 800, 0.0) == 0.0
    assert lim.acquire_now(q, 300, 0.0) > 0.0  # 200 left: refused
    assert lim.acquire_now(q, 200, 0.0) == 0.0  # the refusal took no request slot or tokens


async def test_reconcile_gives_back_unused_tokens() -> None:
    lim = LocalLimiter()
    q = Quota("k", max_requests_per_min=None, max_tokens_per_min=1000)
    assert lim.acquire_now(q, 1000, 0.0) == 0.0  # reserved input + max_tokens
    assert lim.acquire_now(q, 500, 0.0) > 0.0
    await lim.reconcile(q, 600, 0.0)  # only 400 were used
    assert lim.acquire_now(q, 500, 0.0) == 0.0


async def test_reconcile_can_charge_more_than_reserved() -> None:
    lim = LocalLimiter()
    q = Quota("k", max_requests_per_min=None, max_tokens_per_min=600)  # 10 per second
    assert lim.acquire_now(q, 100, 0.0) == 0.0
    await lim.reconcile(q, -600, 0.0)  # used 600 more than reserved: in debt by 100
    assert lim.acquire_now(q, 1, 0.0) == pytest.approx(10.1)


def test_keys_have_separate_buckets() -> None:
    lim = LocalLimiter()
    a = Quota("a", max_requests_per_min=1, max_tokens_per_min=None)
    b = Quota("b", max_requests_per_min=1, max_tokens_per_min=None)
    assert lim.acquire_now(a, 0, 0.0) == 0.0
    assert lim.acquire_now(a, 0, 0.0) > 0.0
    assert lim.acquire_now(b, 0, 0.0) == 0.0
