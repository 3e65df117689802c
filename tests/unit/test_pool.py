"""The pool's routing, health and retry (design §6), over fake members with a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from adapters.base import BackendRejected, BackendUnavailable
from adapters.events import Event, Finish, TextDelta
from adapters.pool import PoolAdapter
from adapters.requests import ChatRequest, Message
from gateway.backends.pool_metrics import PoolCollector
from tests.support.metric_names import MEMBER_METRICS
from tests.support.waiting import until


class Member:
    """A fake member: its health, its reported stats and how its streams go are set by tests."""

    def __init__(self, name: str, fail: Exception | None = None) -> None:
        self.name = name
        self.up = True
        self.hang = False
        self.fail = fail
        self.load = {"waiting": 0, "running": 0, "steps": 0}
        self.served: list[str] = []
        self.hold: asyncio.Event | None = None  # streams wait for it before their first event

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        if self.hang:
            await asyncio.Event().wait()
        return self.up

    async def stats(self) -> dict:
        return dict(self.load)

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return None

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        if self.fail is not None:
            raise self.fail
        self.served.append(request_id)
        if self.hold is not None:
            await self.hold.wait()
        yield [TextDelta(self.name)]
        yield [Finish("stop")]

    async def abort(self, request_id: str) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chat(text: str = "Hi") -> ChatRequest:
    return ChatRequest(model="m", messages=[Message("user", text)])


async def run(pool: PoolAdapter, request: ChatRequest, request_id: str) -> str:
    out = [e for batch in [b async for b in pool.stream(request, request_id)] for e in batch]
    return next(e.text for e in out if type(e) is TextDelta)


def metrics(*pools: PoolAdapter):
    """`value(name, **labels)` over a registry holding the pools' collector."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(list(pools)))
    return lambda name, **labels: registry.get_sample_value(name, labels)


async def test_load_from_the_members_own_stats_decides_and_a_burst_spreads():
    a, b = Member("a"), Member("b")
    a.load = {"waiting": 3, "running": 8, "steps": 1}
    pool = PoolAdapter([a, b])
    await pool.ready()
    served = [await run(pool, chat(f"request {i}"), f"r{i}") for i in range(4)]
    # b reported 0 against a's 11: they go to b (each one counts while it streams)
    assert served == ["b", "b", "b", "b"]
    b.load = {"waiting": 20, "running": 8, "steps": 2}
    await pool.ready()
    assert await run(pool, chat("another"), "r9") == "a"


async def test_a_shared_prefix_goes_back_to_its_member_unless_that_one_is_overloaded():
    a, b = Member("a"), Member("b")
    pool = PoolAdapter([a, b])
    system = "You are a careful assistant. " * 40  # several prefix blocks
    first = await run(pool, chat(system + "first question"), "r1")
    other = await run(pool, chat("unrelated"), "r2")
    assert other != first  # load spreads the unrelated one
    again = [await run(pool, chat(system + f"question {i}"), f"q{i}") for i in range(4)]
    assert again == [first] * 4  # equal loads would have taken turns: the prefix holds them
    assert pool.affinity_routes >= 1
    # the holder is now far busier than the other: load wins
    busy = a if first == "a" else b
    busy.load = {"waiting": 30, "running": 8, "steps": 5}
    await pool.ready()
    assert await run(pool, chat(system + "third question"), "r4") != first


async def test_requests_routed_since_a_report_are_load_while_they_stream_only():
    a, b = Member("a"), Member("b")
    pool = PoolAdapter([a, b])
    await pool.ready()  # both report no work
    system = "You are a careful assistant. " * 40
    first = await run(pool, chat(system + "first"), "r0")
    # one after another, each ended before the next: no load, so the prefix holds them all
    again = [await run(pool, chat(system + f"question {i}"), f"q{i}") for i in range(6)]
    assert again == [first] * 6
    # at once: the holder takes them until it has AFFINITY_SLACK more than the other
    a.hold = b.hold = hold = asyncio.Event()
    burst = [asyncio.create_task(run(pool, chat(system + f"burst {i}"), f"b{i}")) for i in range(4)]
    await until(lambda: len(a.served) + len(b.served) == 11, "the burst to be routed")
    hold.set()
    assert [await t for t in burst] == [first] * 3 + ["b" if first == "a" else "a"]


async def test_a_member_that_fails_before_the_first_event_is_retried_until_its_breaker_opens():
    dead = Member("dead", fail=BackendUnavailable("down"))
    good = Member("good")
    clock = Clock()
    pool = PoolAdapter([dead, good], clock=clock)
    assert [await run(pool, chat(), f"r{i}") for i in range(8)] == ["good"] * 8
    snapshot = {row["member"]: row for row in pool.snapshot()}
    # taking turns, it got every other try until 5 failures in a row opened its breaker
    assert (snapshot["dead"]["failures"], snapshot["dead"]["breaker"]) == (5, "open")
    assert good.served == [f"r{i}" for i in range(8)]


async def test_a_refusal_is_the_requests_own_and_is_not_retried():
    bad = BackendRejected("bad request", "max_tokens")
    first, second = Member("first", fail=bad), Member("second", fail=bad)
    pool = PoolAdapter([first, second])
    with pytest.raises(BackendRejected):  # the refusal reaches the caller
        await run(pool, chat(), "r1")
    assert sum(row["failures"] for row in pool.snapshot()) == 0


async def test_with_every_member_down_the_request_is_unavailable():
    pool = PoolAdapter([Member("x", fail=BackendUnavailable("down"))])
    with pytest.raises(BackendUnavailable):  # no member could serve it
        await run(pool, chat(), "r1")
    assert await pool.ready() is True  # it answers probes: back in for the next request


async def test_a_member_that_does_not_answer_its_probe_is_out_until_it_does():
    hung, good = Member("hung"), Member("good")
    pool = PoolAdapter([hung, good], probe_timeout=0.05)
    hung.hang = True
    assert await pool.ready() is True
    assert [await run(pool, chat(f"q{i}"), f"r{i}") for i in range(3)] == ["good"] * 3
    hung.hang = False
    await pool.ready()
    assert {row["member"]: row["healthy"] for row in pool.snapshot()} == {
        "hung": True,
        "good": True,
    }


async def test_a_member_with_work_whose_steps_stand_still_is_ejected_and_reported():
    stuck, good = Member("stuck"), Member("good")
    clock, stalls = Clock(), []
    pool = PoolAdapter([stuck, good], stall_timeout=10.0, on_stall=stalls.append, clock=clock)
    stuck.load = {"waiting": 1, "running": 2, "steps": 50}
    await pool.ready()
    clock.now += 9.0
    await pool.ready()
    assert stalls == []  # not yet
    clock.now += 2.0
    await pool.ready()
    assert stalls == ["stuck"]
    assert [await run(pool, chat(f"q{i}"), f"r{i}") for i in range(3)] == ["good"] * 3
    clock.now += 30.0
    await pool.ready()
    assert stalls == ["stuck"]  # reported once per stall
    stuck.load = {"waiting": 0, "running": 0, "steps": 0}  # restarted: idle, counting afresh
    await pool.ready()
    assert {row["member"]: row["healthy"] for row in pool.snapshot()}["stuck"] is True
    value = metrics(pool)
    assert value("sluice_member_ejections_total", member="stuck", reason="stall") == 1
    assert value("sluice_member_ejections_total", member="stuck", reason="probe") == 0


async def test_a_member_answering_no_probe_for_the_stall_timeout_is_reported_hung():
    silent, good = Member("silent"), Member("good")
    clock, hung = Clock(), []
    pool = PoolAdapter(
        [silent, good], stall_timeout=10.0, probe_timeout=0.01, on_stall=hung.append, clock=clock
    )
    silent.hang = True  # SIGSTOPped: no answer, so no stats and no steps to stall
    await pool.ready()
    clock.now += 9.0
    await pool.ready()
    assert hung == []  # out of routing, not yet hung
    clock.now += 2.0
    await pool.ready()
    assert hung == ["silent"]  # restarted through the stall's path
    clock.now += 30.0
    await pool.ready()
    assert hung == ["silent"]  # reported once while it stays silent
    silent.hang, silent.up = False, False  # killed: refused while it restarts, an answer
    clock.now += 30.0
    await pool.ready()
    assert hung == ["silent"]  # a member that answers, even "not ready", is not hung
    silent.up = True
    await pool.ready()
    assert {row["member"]: row["healthy"] for row in pool.snapshot()}["silent"] is True
    value = metrics(pool)
    assert value("sluice_member_ejections_total", member="silent", reason="probe") == 1


async def test_a_member_that_answers_not_ready_is_left_to_its_supervisor():
    dead = Member("dead")
    clock, hung = Clock(), []
    pool = PoolAdapter([dead], stall_timeout=1.0, on_stall=hung.append, clock=clock)
    dead.up = False  # exited, or still loading: its port refuses or says 503
    for _ in range(5):
        clock.now += 10
        await pool.ready()
    assert hung == []


async def test_a_member_whose_process_exited_is_out_until_a_probe_finds_it_ready():
    gone, good = Member("gone"), Member("good")
    pool = PoolAdapter([gone, good])
    await pool.ready()
    value = metrics(pool)
    pool.member_exited("gone")  # its supervisor saw the process exit, before any probe
    assert value("sluice_pool_member_healthy", pool=pool.name, member="gone") == 0
    assert [await run(pool, chat(f"q{i}"), f"r{i}") for i in range(3)] == ["good"] * 3
    gone.up = False  # restarted, still loading: its probe says not ready
    await pool.ready()
    assert value("sluice_pool_member_healthy", pool=pool.name, member="gone") == 0
    gone.up = True
    await pool.ready()
    assert value("sluice_pool_member_healthy", pool=pool.name, member="gone") == 1
    assert value("sluice_pool_member_healthy", pool=pool.name, member="good") == 1


async def test_an_idle_member_is_never_stalled():
    idle = Member("idle")
    clock, stalls = Clock(), []
    pool = PoolAdapter([idle], stall_timeout=1.0, on_stall=stalls.append, clock=clock)
    for _ in range(5):
        clock.now += 10
        await pool.ready()
    assert stalls == []


async def test_the_members_are_metrics_under_the_contracts_names():
    a, b = Member("a"), Member("b", fail=BackendUnavailable("down"))
    pool = PoolAdapter([a, b])
    for i in range(3):
        await run(pool, chat(f"q{i}"), f"r{i}")
    registry = CollectorRegistry()
    registry.register(PoolCollector([pool]))
    assert {family.name for family in registry.collect()} >= MEMBER_METRICS
    value = metrics(pool)
    assert value("sluice_member_requests_total", member="a") == 3
    assert value("sluice_member_requests_total", member="b") == 2  # each retried on a
    assert value("sluice_member_failures_total", member="b") == 2
    assert value("sluice_member_ejections_total", member="b", reason="failure") == 0  # not yet
    assert value("sluice_member_ejections_total", member="b", reason="probe") == 0
    assert value("sluice_member_breaker_state", member="b") == 0  # closed: 2 failures of 5
    assert value("sluice_member_ejections_total", member="a", reason="failure") == 0
    assert value("sluice_pool_member_in_flight", pool="pool", member="a") == 0
    assert value("sluice_pool_member_healthy", pool="pool", member="a") == 1
    assert value("sluice_pool_member_stalls_total", pool="pool", member="a") == 0


async def test_an_ejection_is_counted_once_per_time_out_of_routing_by_its_reason():
    flaky, good = Member("flaky"), Member("good")
    clock = Clock()
    pool = PoolAdapter([flaky, good], clock=clock)
    value = metrics(pool)

    def ejections(reason: str) -> float:
        return value("sluice_member_ejections_total", member="flaky", reason=reason)

    flaky.up = False
    for _ in range(4):  # out at the first failed probe, and still out: one ejection
        clock.now += 1
        await pool.ready()
    assert (ejections("probe"), ejections("failure")) == (1, 0)
    flaky.up = True
    await pool.ready()  # back in
    flaky.fail = BackendUnavailable("down")
    for i in range(8):  # failing every other try: its breaker opens at the fifth, then out
        await run(pool, chat(f"q{i}"), f"r{i}")
    pool.members[0].failed(clock.now)  # another request of this gateway failed there meanwhile
    assert value("sluice_member_failures_total", member="flaky") == 6
    assert (ejections("probe"), ejections("failure")) == (1, 1)
    flaky.up = False
    await pool.ready()  # fails its probe while already out: not ejected again
    assert (ejections("probe"), ejections("failure"), ejections("stall")) == (1, 1, 0)


async def test_members_of_one_name_are_told_apart():
    first, second = Member("qwen"), Member("qwen")  # two upstreams of model qwen
    pool = PoolAdapter([first, second])
    assert [row["member"] for row in pool.snapshot()] == ["qwen", "qwen#2"]
    for i in range(2):
        await run(pool, chat(f"q{i}"), f"r{i}")
    value = metrics(pool)
    assert value("sluice_member_requests_total", member="qwen") == 1
    assert value("sluice_member_requests_total", member="qwen#2") == 1
