"""The quota contract: exact rolling-minute rpm and tpm, live-run slots, a budget per period,
refunds at release. Every contract test runs on the in-process store and on a real Redis, with a
fake clock the test advances; the Redis-only tests run two stores as two replicas."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from gateway.state.quotas_redis import RedisQuotaStore
from policies.quotas import (
    LIVE_TTL,
    MemoryQuotaStore,
    QuotaExceeded,
    QuotaLimits,
    QuotaRequest,
    estimate_prompt_tokens,
    openai_duration,
)
from tests.support.redis_scratch import REDIS_URL, scratch_redis

# 20 s before a minute boundary and 1,200 s into an hour-long budget period
START = 1_700_002_800.0 + 1_200.0 - 20.0
assert START % 60 == 40 and START % 3600 == 1180


class FakeClock:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def redis_prefix():
    async with scratch_redis() as scratch:
        yield scratch


@pytest.fixture(params=["memory", "redis"])
async def store(request, clock):
    if request.param == "memory":
        yield MemoryQuotaStore(clock)
        return
    async with scratch_redis() as (client, prefix):
        yield RedisQuotaStore(client, prefix=prefix, clock=clock)


_runs = iter(range(1_000_000))


def make_request(tokens: int = 10, tenant: str = "acme", **limits) -> QuotaRequest:
    return QuotaRequest(tenant, f"run-{next(_runs)}", tokens, QuotaLimits(**limits))


async def refused(store, request: QuotaRequest) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as info:
        await store.admit(request)
    return info.value


def test_openai_duration_uses_gos_form_rounded_up_to_the_millisecond():
    table = {
        0: "0s",
        -3: "0s",
        0.0004: "1ms",
        0.012: "12ms",
        0.999: "999ms",
        1: "1s",
        1.5: "1.5s",
        12.34: "12.34s",
        60: "1m0s",
        360: "6m0s",
        3600: "1h0m0s",
        3723: "1h2m3s",
        86_400 * 30: "720h0m0s",
    }
    assert {seconds: openai_duration(seconds) for seconds in table} == table


def test_prompt_estimate_is_a_third_of_the_utf8_bytes_plus_framing():
    assert estimate_prompt_tokens([]) == 3
    assert estimate_prompt_tokens([("user", "hello")]) == 3 + 2 + 4
    assert estimate_prompt_tokens([("system", "abc"), ("user", "é" * 4)]) == 3 + (1 + 4) + (3 + 4)


async def test_rpm_is_exact_over_a_rolling_minute(store, clock):
    limits = {"rpm": 5}
    for _ in range(5):
        await store.admit(make_request(**limits))
        clock.advance(2)  # admissions at 0, 2, 4, 6, 8 s
    error = await refused(store, make_request(**limits))
    assert (error.limit, error.code) == ("requests", "rate_limit_exceeded")
    assert error.retry_after == pytest.approx(50.0)  # the first leaves the window at 60 s
    assert error.headers["retry-after"] == "50"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.headers["x-ratelimit-reset-requests"] == "50s"
    assert "5 requests per minute" in error.message and "50s" in error.message
    clock.advance(49.999)
    await refused(store, make_request(**limits))
    clock.advance(0.001)
    admission = await store.admit(make_request(**limits))
    assert admission.headers["x-ratelimit-remaining-requests"] == "0"
    assert admission.headers["x-ratelimit-reset-requests"] == "2s"  # the one admitted at 2 s


async def test_a_minute_boundary_does_not_reset_the_window(store, clock):
    limits = {"rpm": 4}
    for _ in range(3):
        await store.admit(make_request(**limits))  # 20 s before the minute turns
    clock.advance(30)  # 10 s into the next minute: a fixed window would start afresh here
    await store.admit(make_request(**limits))
    error = await refused(store, make_request(**limits))
    assert error.retry_after == pytest.approx(30.0)


async def test_tpm_reserves_and_a_release_refunds_at_once(store, clock):
    limits = {"tpm": 1000}
    first = await store.admit(make_request(600, **limits))
    assert first.headers["x-ratelimit-remaining-tokens"] == "400"
    clock.advance(10)
    error = await refused(store, make_request(500, **limits))
    assert (error.limit, error.code) == ("tokens", "rate_limit_exceeded")
    assert error.retry_after == pytest.approx(50.0)
    assert "1000 tokens per minute" in error.message
    await store.release(first, used_tokens=100)
    second = await store.admit(make_request(500, **limits))
    assert second.headers["x-ratelimit-remaining-tokens"] == "400"
    await store.release(second, used_tokens=900)  # more than reserved: charged what it used
    assert (await store.headers("acme", QuotaLimits(**limits)))[
        "x-ratelimit-remaining-tokens"
    ] == "0"
    error = await refused(store, make_request(1, **limits))
    assert error.retry_after == pytest.approx(50.0)  # the first run's 100 leave first
    clock.advance(50)
    await store.admit(make_request(100, **limits))


async def test_a_reservation_above_tpm_can_never_pass(store):
    error = await refused(store, make_request(1001, tpm=1000))
    assert (error.limit, error.code) == ("tokens", "rate_limit_exceeded")
    assert "1001" in error.message and "never" in error.message
    assert error.headers["x-ratelimit-remaining-tokens"] == "1000"  # nothing was taken


async def test_concurrency_refuses_until_a_release(store, clock):
    limits = {"max_concurrent": 2}
    first = await store.admit(make_request(**limits))
    await store.admit(make_request(**limits))
    error = await refused(store, make_request(**limits))
    assert (error.limit, error.code, error.retry_after) == ("concurrency", "rate_limit_exceeded", 1)
    assert error.headers == {"retry-after": "1"}  # no rpm/tpm: no x-ratelimit pairs
    assert "2 concurrent requests" in error.message
    await store.release(first, used_tokens=10)
    await store.admit(make_request(**limits))
    await refused(store, make_request(**limits))


async def test_release_is_idempotent(store):
    limits = {"max_concurrent": 2, "tpm": 100}
    first = await store.admit(make_request(50, **limits))
    await store.admit(make_request(40, **limits))
    await store.release(first, used_tokens=10)
    await store.release(first, used_tokens=0)  # no second refund, no second slot
    assert (await store.headers("acme", QuotaLimits(**limits)))[
        "x-ratelimit-remaining-tokens"
    ] == "50"
    await store.admit(make_request(10, **limits))
    error = await refused(store, make_request(10, **limits))
    assert error.limit == "concurrency"


async def test_budget_is_insufficient_quota_until_the_period_ends(store, clock):
    limits = {"budget_tokens": 1000, "budget_period": 3600.0}
    first = await store.admit(make_request(600, **limits))
    error = await refused(store, make_request(500, **limits))
    assert (error.limit, error.code) == ("budget", "insufficient_quota")
    assert error.retry_after == pytest.approx(3600 - 1180)  # periods align to the epoch
    assert error.headers["retry-after"] == "2420"
    assert "1000 tokens per 1h0m0s" in error.message and "40m20s" in error.message
    await store.release(first, used_tokens=200)  # refunded within the period
    await store.admit(make_request(500, **limits))
    await refused(store, make_request(301, **limits))
    clock.advance(3600 - 1180)  # the next period starts afresh
    await store.admit(make_request(1000, **limits))


async def test_a_refused_admission_consumes_nothing(store, clock):
    limits = {"rpm": 10, "tpm": 100, "max_concurrent": 1, "budget_tokens": 1000}
    limits["budget_period"] = 3600.0
    holder = await store.admit(make_request(30, **limits))
    before = await store.headers("acme", QuotaLimits(**limits))
    for _ in range(5):
        assert (await refused(store, make_request(30, **limits))).limit == "concurrency"
        assert (await refused(store, make_request(80, **limits))).limit in {"tokens", "concurrency"}
    assert await store.headers("acme", QuotaLimits(**limits)) == before
    await store.release(holder, used_tokens=30)
    for _ in range(9):  # the holder took one request of ten, and nothing more was taken
        admission = await store.admit(make_request(0, **limits))
        await store.release(admission, used_tokens=0)
    assert (await refused(store, make_request(0, **limits))).limit == "requests"


async def test_the_longest_wait_names_the_refusal(store, clock):
    limits = {"rpm": 1, "budget_tokens": 100, "budget_period": 3600.0}
    await store.admit(make_request(100, **limits))
    error = await refused(store, make_request(1, **limits))
    assert error.limit == "budget"  # a retry after the rpm window would still be refused


async def test_headers_report_without_consuming(store, clock):
    limits = QuotaLimits(rpm=3, tpm=100)
    assert await store.headers("acme", limits) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "0s",
    }
    await store.admit(QuotaRequest("acme", "run-a", 30, limits))
    clock.advance(0.988)
    expected = {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "59.012s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "70",
        "x-ratelimit-reset-tokens": "59.012s",
    }
    assert await store.headers("acme", limits) == expected
    assert await store.headers("acme", limits) == expected
    assert await store.headers("acme", QuotaLimits(tpm=100)) == {
        k: v for k, v in expected.items() if "tokens" in k
    }
    assert await store.headers("acme", QuotaLimits()) == {}


async def test_tenants_do_not_share_limits(store):
    await store.admit(make_request(tenant="acme", rpm=1))
    error = await refused(store, make_request(tenant="acme", rpm=1))
    assert "globex" not in error.message
    await store.admit(make_request(tenant="globex", rpm=1))


async def test_a_lost_slot_comes_back_after_its_ttl(store, clock):
    limits = {"max_concurrent": 1, "tpm": 1000}
    lost = await store.admit(make_request(100, **limits))
    clock.advance(LIVE_TTL - 1)
    await refused(store, make_request(**limits))
    clock.advance(1)
    await store.admit(make_request(**limits))
    await store.release(lost, used_tokens=0)  # too late: a no-op, the new run keeps its slot
    await refused(store, make_request(**limits))


async def test_a_live_run_admitted_again_is_admitted_once(store):
    """A Redis client resends an admission whose reply was lost; every store answers a live
    run's admission again without counting it twice."""
    request = make_request(rpm=10, max_concurrent=2)
    first = await store.admit(request)
    again = await store.admit(request)
    assert again.run_id == first.run_id
    assert again.headers["x-ratelimit-remaining-requests"] == "9"  # one request, not two
    await store.admit(make_request(rpm=10, max_concurrent=2))  # the second slot is free
    assert (await refused(store, make_request(rpm=10, max_concurrent=2))).limit == "concurrency"
    await store.release(first, 5)
    await store.admit(make_request(rpm=10, max_concurrent=2))  # one release frees its slot


async def test_an_admission_reports_the_usage_it_leaves(store, clock):
    """Both stores report the tenant's usage after the admission, that run included: what a
    replica judges the tenant's headroom by (policies/headroom.py)."""
    limits = {"rpm": 10, "tpm": 1000, "max_concurrent": 5, "budget_tokens": 5000}
    limits |= {"budget_period": 3600.0}
    first = await store.admit(make_request(100, **limits))
    clock.advance(1)
    second = await store.admit(make_request(40, **limits))
    usage = second.usage
    assert (usage.requests, usage.tokens, usage.live, usage.budget_used) == (2, 140, 2, 140)
    assert usage.now_us == round(clock.now * 1_000_000)
    assert first.usage.live == 1 and first.usage.budget_used == 100


async def test_replicas_share_rpm_exactly(redis_prefix, clock):
    client, prefix = redis_prefix
    other = Redis.from_url(REDIS_URL)
    try:
        replicas = [RedisQuotaStore(c, prefix=prefix, clock=clock) for c in (client, other)]
        requests = [make_request(rpm=20) for _ in range(50)]
        results = await asyncio.gather(
            *(replicas[i % 2].admit(r) for i, r in enumerate(requests)), return_exceptions=True
        )
    finally:
        await other.aclose()
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refusals = [r for r in results if isinstance(r, BaseException)]
    assert len(admitted) == 20
    assert all(isinstance(e, QuotaExceeded) and e.limit == "requests" for e in refusals)


async def test_replicas_share_concurrency_exactly(redis_prefix, clock):
    client, prefix = redis_prefix
    other = Redis.from_url(REDIS_URL)
    try:
        a, b = (RedisQuotaStore(c, prefix=prefix, clock=clock) for c in (client, other))
        requests = [make_request(max_concurrent=3, tpm=10_000) for _ in range(30)]
        results = await asyncio.gather(
            *((a, b)[i % 2].admit(r) for i, r in enumerate(requests)), return_exceptions=True
        )
        admitted = [r for r in results if not isinstance(r, BaseException)]
        assert len(admitted) == 3
        await asyncio.gather(*(b.release(x, 5) for x in admitted), a.release(admitted[0], 5))
        limits = QuotaLimits(max_concurrent=3, tpm=10_000)
        assert (await a.headers("acme", limits))["x-ratelimit-remaining-tokens"] == "9985"
        again = await asyncio.gather(
            *(a.admit(make_request(max_concurrent=3)) for _ in range(5)), return_exceptions=True
        )
        assert sum(not isinstance(r, BaseException) for r in again) == 3
    finally:
        await other.aclose()


async def test_redis_keys_expire_so_idle_tenants_leave_nothing(redis_prefix, clock):
    client, prefix = redis_prefix
    store = RedisQuotaStore(client, prefix=prefix, clock=clock)
    limits = {"rpm": 5, "tpm": 100, "max_concurrent": 2, "budget_tokens": 100}
    limits["budget_period"] = 3600.0
    admission = await store.admit(make_request(10, **limits))
    await store.release(admission, used_tokens=5)
    await store.admit(make_request(10, **limits))
    ttls = {key.decode(): await client.pttl(key) async for key in client.scan_iter(f"{prefix}*")}
    suffixes = {key.rsplit(":", 1)[-1] if "budget" not in key else "budget" for key in ttls}
    assert suffixes == {"window", "amounts", "held", "live", "pending", "budget"}
    assert all(0 < ttl <= (LIVE_TTL + 1) * 1000 for ttl in ttls.values()), ttls
