"""A pool member that dies, hangs or stalls mid-stream (design §6): the run continues on another
member from the exact token, or ends with `worker_failed`, never a hang. Over fake members that
generate like a greedy worker: always the same tokens, continuing from a `continuation`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from adapters.base import BackendFailed
from adapters.events import Accepted, Admitted, ErrorEvent, Event, Finish, TextDelta, Usage
from adapters.pool import PoolAdapter
from adapters.pool_members import EVICT_AFTER_PROBES
from adapters.requests import ChatRequest, Message
from gateway.backends.pool_metrics import PoolCollector
from tests.support.waiting import until

TOKENS = list(range(100, 120))
WHOLE = "".join(f"<{t}>" for t in TOKENS)


class GreedyMember:
    """Generates TOKENS one per batch, as greedy decoding would, and takes up a run from its
    `continuation`; it can be made to die or hang after some tokens of a stream."""

    def __init__(self, name: str, *, traced: bool = True, continues: bool = True) -> None:
        self.name = name
        self.traced = traced  # its tokens come with their ids (our own workers)
        self.continues_runs = continues
        self.up = True
        self.silent = False  # probes hang (SIGSTOP)
        self.steps = 0
        self.working = 0
        self.die_after: int | None = None
        self.hang_after: int | None = None
        self.continuations: list[list[int] | None] = []
        self.hanging = asyncio.Event()  # set once a stream hangs
        self.died = asyncio.Event()  # set once a stream dies

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        if self.silent:
            await asyncio.Event().wait()
        return self.up

    async def stats(self) -> dict:
        return {"waiting": 0, "running": self.working, "steps": self.steps}

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return None

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        done = list(request.continuation or [])
        assert done == TOKENS[: len(done)], "a continuation is what was generated, in order"
        self.continuations.append(request.continuation)
        yield [Accepted()]
        yield [Admitted()]
        self.working += 1
        try:
            for sent, token in enumerate(TOKENS[len(done) :]):
                if sent == self.die_after:
                    self.died.set()
                    raise BackendFailed("The connection to the model worker was lost.")
                if sent == self.hang_after:
                    self.hanging.set()
                    await asyncio.Event().wait()
                self.steps += 1
                ids = [token] if self.traced else None
                yield [TextDelta(f"<{token}>", token_ids=ids)]
            yield [Finish("length"), Usage(5, len(TOKENS))]
        finally:
            self.working -= 1

    async def abort(self, request_id: str) -> bool:
        return True


def chat(n: int = 1) -> ChatRequest:
    return ChatRequest(model="m", messages=[Message("user", "Hi")], n=n)


async def collect(pool: PoolAdapter, request: ChatRequest | None = None) -> list[Event]:
    return [e for b in [b async for b in pool.stream(request or chat(), "r1")] for e in b]


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events if type(e) is TextDelta)


def kinds(events: list[Event], kind: type) -> list[Event]:
    return [e for e in events if type(e) is kind]


async def test_a_member_that_dies_mid_stream_is_continued_from_the_exact_token():
    first, second = GreedyMember("first"), GreedyMember("second")
    first.die_after = 7
    pool = PoolAdapter([first, second])
    events = await collect(pool)
    assert text(events) == WHOLE  # no gap, nothing repeated
    assert second.continuations == [TOKENS[:7]]
    assert len(kinds(events, Accepted)) == len(kinds(events, Admitted)) == 1
    assert kinds(events, Usage) == [Usage(5, len(TOKENS))]  # both members' tokens
    assert pool.migrations == {"continued": 1}
    assert {r["member"]: r["failures"] for r in pool.snapshot()} == {"first": 1, "second": 0}


async def test_a_member_that_stops_answering_mid_stream_has_its_run_moved():
    first, second = GreedyMember("first"), GreedyMember("second")
    first.hang_after = 4
    pool = PoolAdapter([first, second], probe_timeout=0.01)
    await pool.ready()
    task = asyncio.create_task(collect(pool))
    await first.hanging.wait()
    first.silent = True  # SIGSTOP: its probes time out too
    for _ in range(EVICT_AFTER_PROBES):
        assert not task.done()
        await pool.ready()
    events = await task
    assert text(events) == WHOLE
    assert second.continuations == [TOKENS[:4]]


async def test_a_stalled_engine_has_its_run_moved():
    first, second = GreedyMember("first"), GreedyMember("second")
    first.hang_after = 3
    now = [100.0]
    pool = PoolAdapter([first, second], stall_timeout=10.0, clock=lambda: now[0])
    await pool.ready()
    task = asyncio.create_task(collect(pool))
    await first.hanging.wait()
    await pool.ready()  # it has work, its steps stand
    now[0] += 11.0
    await pool.ready()  # stalled: its streams go elsewhere
    events = await task
    assert text(events) == WHOLE
    assert second.continuations == [TOKENS[:3]]


async def test_a_run_from_a_member_that_cannot_be_continued_ends_worker_failed():
    upstream, other = GreedyMember("upstream", traced=False, continues=False), GreedyMember("w")
    upstream.die_after = 5
    pool = PoolAdapter([upstream, other])
    pool.choose = lambda request, tried, run=None: (  # the upstream gets it first
        None if (run is not None and run.generated) or 0 in tried else 0
    )
    events = await collect(pool)
    assert text(events) == WHOLE[: len("<100>") * 5]  # what it had sent stays sent
    (error,) = kinds(events, ErrorEvent)
    assert error.code == "worker_failed"
    assert other.continuations == []
    assert pool.migrations == {"not_continuable": 1}


async def test_several_choices_are_not_continued():
    first, second = GreedyMember("first"), GreedyMember("second")
    first.die_after = 2
    pool = PoolAdapter([first, second])
    events = await collect(pool, chat(n=2))
    assert kinds(events, ErrorEvent)[0].code == "worker_failed"
    assert pool.migrations == {"not_continuable": 1}


async def test_a_continuation_waits_for_a_member_to_come_back():
    only = GreedyMember("only")
    only.die_after = 6
    pool = PoolAdapter([only], migration_wait=30.0)
    only.up = False  # dead: its probes fail until it is restarted
    task = asyncio.create_task(collect(pool))
    await only.died.wait()
    await until(lambda: only.working == 0, "the cut stream to be closed")
    only.die_after = None
    only.up = True  # restarted
    await pool.ready()
    events = await task
    assert text(events) == WHOLE
    assert only.continuations == [None, TOKENS[:6]]


async def test_no_member_to_continue_on_ends_worker_failed_and_is_counted():
    worker, upstream = GreedyMember("worker"), GreedyMember("upstream", continues=False)
    worker.die_after = 3
    pool = PoolAdapter([worker, upstream], migration_wait=0.05)
    pool.router.choose = lambda members, usable, request: usable[0]
    events = await collect(pool)
    assert kinds(events, ErrorEvent)[0].code == "worker_failed"
    assert upstream.continuations == []  # an OpenAI-compatible member is never asked to continue
    assert pool.migrations == {"failed": 1}
    registry_value = _metric(pool, "sluice_run_migrations_total", outcome="failed")
    assert registry_value == 1


def _metric(pool: PoolAdapter, name: str, **labels: str) -> float | None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(PoolCollector([pool]))
    return registry.get_sample_value(name, {"pool": pool.name, **labels})


async def test_a_run_cut_before_its_first_token_starts_afresh_on_any_member():
    queued, upstream = GreedyMember("queued"), GreedyMember("upstream", continues=False)
    queued.die_after = 0  # accepted and admitted, then gone before a token
    pool = PoolAdapter([queued, upstream])
    pool.router.choose = lambda members, usable, request: usable[0]
    events = await collect(pool, chat(n=2))
    assert text(events) == WHOLE
    assert upstream.continuations == [None]  # the request itself, from the start
    assert len(kinds(events, Accepted)) == 1
    assert pool.migrations == {"continued": 1}


async def test_a_cancel_of_the_reading_task_is_not_taken_for_a_lost_member():
    """Only the pool's own eviction of a lease turns a cancelled read into a move: a cancel of
    the task reading the run (its driver's, a shutdown) goes on up, and nothing is continued."""
    first, second = GreedyMember("first"), GreedyMember("second")
    first.hang_after = 4
    pool = PoolAdapter([first, second])
    task = asyncio.create_task(collect(pool))
    await first.hanging.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert second.continuations == [] and pool.migrations == {}
    assert pool._serving == {}  # the lease was given back
