"""Circuit breakers and the retry budget in a pool (design §6), over scripted members and a fake
clock: a failing member's breaker opens and its traffic goes to the healthy one, one request
probes it after the cooldown, a retry-after is honoured, and retries stay within the budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from adapters.base import BackendFailed, BackendRejected, BackendUnavailable, ModelInfo
from adapters.breaker import BreakerPolicy
from adapters.events import Accepted, ErrorEvent, Event, Finish, TextDelta, Usage
from adapters.pool import PoolAdapter
from adapters.requests import ChatRequest, Message
from adapters.retry_budget import RetryBudget
from gateway.app_keys import RETRY_BUDGET
from gateway.backends.pool_metrics import PoolCollector, RetryCollector
from tests.support.gateway import gateway_app
from tests.support.loops import ON_EITHER_LOOP
from tests.support.waiting import until

NEVER = BreakerPolicy(consecutive=10**9, min_requests=10**9)  # a breaker that never opens


class Flaky:
    """A member that serves its name as one token, unless told to fail: `fail` is raised before
    the first event; `cut` ends a stream after its first token (a broken connection), and
    `error` sends the upstream's in-band error instead of a token."""

    def __init__(self, name: str, fail: Exception | None = None) -> None:
        self.name = name
        self.fail = fail
        self.cut = False
        self.error = False
        self.tries = 0
        self.hold: asyncio.Event | None = None  # streams wait for it before their first event

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo("m")]

    async def ready(self) -> bool:
        return True

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return None

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        self.tries += 1
        if self.fail is not None:
            raise self.fail
        if self.hold is not None:
            await self.hold.wait()
        yield [Accepted()]
        if self.error:
            yield [ErrorEvent("upstream_error", "The upstream model failed while generating.")]
            return
        yield [TextDelta(self.name)]
        if self.cut:
            raise BackendFailed("The connection to the upstream model server was lost.")
        yield [Finish("stop"), Usage(3, 1)]

    async def abort(self, request_id: str) -> bool:
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(*members: Flaky, clock: Clock, **options) -> PoolAdapter:
    """A pool whose router takes the first usable member (the failing one, while it is in), with
    a budget on the same clock and no backoff to wait out."""
    options.setdefault("retry_budget", RetryBudget(0.2, clock=clock, backoff_base=0.0))
    pool = PoolAdapter(list(members), clock=clock, **options)
    pool.router.choose = lambda all_members, usable, request: usable[0]
    return pool


def chat() -> ChatRequest:
    return ChatRequest(model="m", messages=[Message("user", "Hi")])


async def run(pool: PoolAdapter, request_id: str) -> str:
    """The text of the request's answer (the member's name), or its error code."""
    events = [e for b in [b async for b in pool.stream(chat(), request_id)] for e in b]
    errors = [e.code for e in events if type(e) is ErrorEvent]
    return errors[0] if errors else "".join(e.text for e in events if type(e) is TextDelta)


def breaker(pool: PoolAdapter, member: str) -> str:
    return {row["member"]: row["breaker"] for row in pool.snapshot()}[member]


def metrics(pool: PoolAdapter):
    registry = CollectorRegistry()
    registry.register(PoolCollector([pool]))
    registry.register(RetryCollector(pool.budget))
    return lambda name, **labels: registry.get_sample_value(name, labels)


async def test_a_failing_members_breaker_opens_and_its_traffic_goes_to_the_healthy_one():
    bad, good = Flaky("bad", fail=BackendFailed("upstream answered HTTP 500")), Flaky("good")
    clock = Clock()
    pool = pool_of(bad, good, clock=clock)
    value = metrics(pool)
    assert [await run(pool, f"r{i}") for i in range(10)] == ["good"] * 10
    assert bad.tries == 5  # five in a row opened it; the next five went straight to good
    assert value("sluice_member_breaker_state", member="bad") == 2
    assert value("sluice_member_breaker_state", member="good") == 0
    assert value("sluice_member_ejections_total", member="bad", reason="failure") == 1
    assert value("sluice_retries_total", reason="failed") == 5
    assert value("sluice_retries_total", reason="budget_exhausted") == 0
    assert await pool.ready() is True  # a probe passing does not close it: distinct from health
    assert breaker(pool, "bad") == "open"

    clock.now += 6.0  # its cooldown (5 s, within a fifth either way) is over
    assert breaker(pool, "bad") == "half_open"
    assert value("sluice_member_breaker_state", member="bad") == 1
    bad.fail, bad.hold = None, asyncio.Event()  # it recovered; its answer takes a while
    probe = asyncio.create_task(run(pool, "probe"))
    await until(lambda: bad.tries == 6, "the probe to reach the member")
    # exactly one request probes: the others go on to the healthy member meanwhile
    assert [await run(pool, f"s{i}") for i in range(3)] == ["good"] * 3
    bad.hold.set()
    assert await probe == "bad"
    assert breaker(pool, "bad") == "closed"
    assert await run(pool, "after") == "bad"


async def test_a_failed_probe_reopens_it_for_a_longer_cooldown():
    bad, good = Flaky("bad", fail=BackendUnavailable("down", status=503)), Flaky("good")
    clock = Clock()
    pool = pool_of(bad, good, clock=clock)
    for i in range(5):
        await run(pool, f"r{i}")
    clock.now += 6.0
    assert await run(pool, "probe") == "good"  # the probe failed there, and was retried
    assert (bad.tries, breaker(pool, "bad")) == (6, "open")
    clock.now += 7.0  # past the first cooldown, not the second (10 s, within a fifth)
    assert breaker(pool, "bad") == "open"
    clock.now += 6.0
    assert breaker(pool, "bad") == "half_open"


@pytest.mark.parametrize("how", ["cut", "error"])
async def test_failures_after_the_first_event_count_too(how):
    bad, good = Flaky("bad"), Flaky("good")
    setattr(bad, how, True)
    clock = Clock()
    pool = pool_of(bad, good, clock=clock)
    for i in range(5):
        await run(pool, f"r{i}")
    # cut after its first token: a success then a failure each, half of 10 outcomes; an
    # in-band error before any token: a failure each, five in a row
    assert breaker(pool, "bad") == "open"
    assert await run(pool, "next") == "good"
    assert bad.tries == 5


async def test_a_requests_own_error_is_not_the_members_failure():
    picky = Flaky("picky", fail=BackendRejected("bad request", "max_tokens"))
    clock = Clock()
    pool = pool_of(picky, Flaky("good"), clock=clock)
    for i in range(8):
        with pytest.raises(BackendRejected):
            await run(pool, f"r{i}")
    assert breaker(pool, "picky") == "closed"
    assert pool.budget.counts == {}


async def test_a_members_retry_after_is_honoured_whatever_its_probes_say():
    told = BackendUnavailable("busy", 3.0, status=429, upstream_retry_after=3.0)
    limited, good = Flaky("limited", fail=told), Flaky("good")
    clock = Clock()
    pool = pool_of(limited, good, clock=clock)
    assert await run(pool, "r0") == "good"  # retried elsewhere at once
    limited.fail = None
    assert await pool.ready() is True
    assert [await run(pool, f"r{i}") for i in range(1, 4)] == ["good"] * 3  # skipped until then
    assert limited.tries == 1
    clock.now += 3.0
    assert await run(pool, "later") == "limited"
    assert pool.budget.counts == {"rate_limited": 1}
    assert breaker(pool, "limited") == "closed"


async def test_a_retry_the_budget_refuses_fails_the_request_with_its_own_error():
    bad, good = Flaky("bad", fail=BackendFailed("upstream answered HTTP 500")), Flaky("good")
    clock = Clock()
    pool = pool_of(bad, good, clock=clock, retry_budget=RetryBudget(0.0, clock=clock))
    with pytest.raises(BackendFailed):  # as if no other member were left
        await run(pool, "r0")
    assert good.tries == 0
    value = metrics(pool)
    assert value("sluice_retries_total", reason="budget_exhausted") == 1
    assert value("sluice_retries_total", reason="failed") == 0


async def test_a_lone_member_that_fails_asks_the_budget_for_nothing():
    pool = pool_of(Flaky("only", fail=BackendFailed("upstream answered HTTP 500")), clock=Clock())
    with pytest.raises(BackendFailed):
        await run(pool, "r0")
    assert pool.budget.counts == {}


async def steady_load(pool: PoolAdapter, clock: Clock, requests: int, every: float) -> list[str]:
    """`requests` one after another, `every` seconds apart; each one's answer or error."""
    answers = []
    for i in range(requests):
        clock.now += every
        try:
            answers.append(await run(pool, f"r{i}"))
        except BackendUnavailable as exc:
            answers.append(f"{exc.status}")
    return answers


async def test_retries_stay_within_the_budget_when_a_member_always_fails():
    bad, good = Flaky("bad", fail=BackendUnavailable("down", status=503)), Flaky("good")
    clock = Clock()
    budget = RetryBudget(0.2, clock=clock, backoff_base=0.0)
    pool = PoolAdapter(
        [bad, good], routing="least_load", breaker=NEVER, retry_budget=budget, clock=clock
    )
    answers = await steady_load(pool, clock, 200, 0.02)
    attempts = bad.tries + good.tries
    assert attempts <= 1.2 * 200  # the budget alone bounds the amplification
    refused = answers.count("503")  # its own error: the 503 it answered
    assert refused == budget.counts["budget_exhausted"] > 0
    assert answers.count("good") == 200 - refused


async def test_with_its_breaker_a_dead_member_costs_no_request_and_few_retries():
    bad, good = Flaky("bad", fail=BackendUnavailable("down", status=503)), Flaky("good")
    clock = Clock()
    budget = RetryBudget(0.2, clock=clock, backoff_base=0.0)
    pool = PoolAdapter([bad, good], routing="least_load", retry_budget=budget, clock=clock)
    answers = await steady_load(pool, clock, 300, 0.1)  # 30 s of steady load
    assert answers == ["good"] * 300
    # opened after 5 failures in its first second; each later probe failed and reopened it
    assert bad.tries <= 5 + 3
    assert bad.tries + good.tries <= 1.2 * 300


async def test_readyz_and_metrics_show_the_breakers_and_the_gateways_retries(aiohttp_client):
    bad, good = Flaky("bad", fail=BackendFailed("upstream answered HTTP 500")), Flaky("good")
    clock = Clock()
    pool = pool_of(bad, good, clock=clock, model="m")
    app = gateway_app(adapters=[pool], retry_budget=0.5)
    assert app[RETRY_BUDGET].ratio == 0.5
    pool.budget = app[RETRY_BUDGET]  # as the app's own pools have it
    client = await aiohttp_client(app)
    for i in range(5):
        await run(pool, f"r{i}")
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["breakers"] == {"m": {"bad": "open"}}
    text = await (await client.get("/metrics")).text()
    assert 'sluice_member_breaker_state{member="bad"} 2.0' in text
    assert 'sluice_retries_total{reason="failed"} 5.0' in text
    assert 'sluice_retries_total{reason="budget_exhausted"} 0.0' in text


async def test_a_wait_for_a_rest_to_end_that_wakes_a_little_early_still_finds_the_member_back(
    monkeypatch,
):
    """uvloop's timers keep whole milliseconds of the loop's clock and may fire a fraction of
    one early: the request must not find the member still resting by that fraction and fail."""
    now = [100.0]
    told = BackendUnavailable("busy", 1.0, status=429, upstream_retry_after=1.0)
    limited, bad = Flaky("limited", fail=told), Flaky("bad", fail=BackendFailed("HTTP 500"))
    budget = RetryBudget(0.2, backoff_base=0.0)
    pool = PoolAdapter([limited, bad], retry_budget=budget, clock=lambda: now[0])
    pool.router.choose = lambda all_members, usable, request: usable[0]
    waits: list[float] = []
    sleep = asyncio.sleep

    async def early_sleep(seconds: float) -> None:
        waits.append(seconds)
        if seconds > 0:
            limited.fail = None  # its rest ends on time: it takes work again once it is over
            now[0] += seconds - 0.0009  # the timer fires 0.9 ms before what it was asked
        await sleep(0)

    monkeypatch.setattr("adapters.pool.asyncio.sleep", early_sleep)
    assert await run(pool, "r") == "limited"
    assert limited.tries == 2 and bad.tries == 1
    assert max(waits) > 1.0  # it waited out the whole rest, and a little past it


@ON_EITHER_LOOP  # the rest's end is awaited with a timer: uvloop's may fire a little early
async def test_a_request_whose_other_members_all_rest_waits_for_the_first_back():
    told = BackendUnavailable("busy", 0.2, status=429, upstream_retry_after=0.2)
    limited, bad = Flaky("limited", fail=told), Flaky("bad", fail=BackendFailed("HTTP 500"))
    pool = PoolAdapter([limited, bad], retry_budget=RetryBudget(0.2, backoff_base=0.0))
    pool.router.choose = lambda all_members, usable, request: usable[0]

    async def served_once_rested() -> str:
        answer = asyncio.create_task(run(pool, "r"))
        await until(lambda: bad.tries == 1, "the request to have failed on both members")
        limited.fail = None  # its retry-after ends in 0.2 s: it takes work again
        return await answer

    assert await asyncio.wait_for(served_once_rested(), 5) == "limited"
    assert limited.tries == 2
