"""In-band aborts: `Adapter.abort(id)` and the `Admitted` / `Aborted` events, adapter by adapter.

The worker adapter runs against a real worker app on the tiny model; the pool routes to scripted
members; the scripted adapter behaves like a worker (an abort wakes a sleep and is confirmed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import orjson
import pytest

from adapters.chat_chunks import ChunkRenderer, CompletionBuilder
from adapters.events import Aborted, Admitted, Event, Finish, TextDelta, Usage
from adapters.openai_upstream import OpenAIUpstreamAdapter
from adapters.pool import PoolAdapter
from adapters.requests import ChatRequest, Message
from adapters.worker_client import WorkerAdapter
from testkit.scripted_adapter import ScriptedAdapter, Step, text_script
from tests.support.waiting import until
from tests.support.worker_app import started_worker_app


def chat(max_tokens: int | None = None, **overrides) -> ChatRequest:
    return ChatRequest(
        "m", [Message("user", "Hi")], max_tokens=max_tokens, stream=True, **overrides
    )


def flat(batches: list[list[Event]]) -> list[Event]:
    return [event for batch in batches for event in batch]


def text_tokens(events: list[Event]) -> int:
    return sum(e.tokens for e in events if type(e) is TextDelta)


# -- the worker adapter against a real worker app ----------------------------------------------


@pytest.fixture
async def worker(aiohttp_client, loaded, tiny_model_dir):
    return await started_worker_app(aiohttp_client, loaded, tiny_model_dir)


@pytest.fixture
async def adapter(worker) -> AsyncIterator[WorkerAdapter]:
    adapter = WorkerAdapter(str(worker.make_url("/")))
    await adapter.start()
    yield adapter
    await adapter.close()


async def test_worker_stream_is_admitted_before_its_first_text(adapter: WorkerAdapter) -> None:
    events = flat([b async for b in adapter.stream(chat(8, temperature=0.0), "adm-1")])
    kinds = [type(e) for e in events]
    assert kinds.count(Admitted) == 1
    assert kinds.index(Admitted) < kinds.index(TextDelta)
    assert Aborted not in kinds
    assert isinstance(events[-1], Usage)


async def test_worker_abort_is_confirmed_in_band_then_the_stream_ends(
    adapter: WorkerAdapter,
) -> None:
    seen: list[Event] = []
    after: list[Event] = []
    stream = adapter.stream(chat(1000, temperature=0.0), "long-1")
    async with contextlib.aclosing(stream):
        async for batch in stream:
            seen += batch
            if sum(type(e) is TextDelta for e in seen) >= 3:
                break
        assert await adapter.abort("long-1") is True
        async for batch in stream:  # the same stream goes on to its confirmation
            after += batch
    [aborted] = [e for e in after if type(e) is Aborted]
    assert aborted.index == 0
    assert aborted.completion_tokens >= text_tokens(seen + after)
    assert aborted.completion_tokens < 1000
    assert aborted.tail_tokens in (0, 1)
    assert aborted.stop_latency_ms is not None and 0 <= aborted.stop_latency_ms < 10_000
    assert not any(type(e) is TextDelta for e in after[after.index(aborted) :])
    assert not any(type(e) is Finish for e in seen + after)
    assert after[-1] == Usage(17, aborted.completion_tokens)
    assert await adapter.abort("long-1") is False  # finished: the worker no longer knows it


async def test_worker_abort_of_an_unknown_id_is_false(adapter: WorkerAdapter) -> None:
    assert await adapter.abort("never-seen") is False


async def test_worker_abort_is_false_when_the_worker_is_gone(worker, adapter) -> None:
    await worker.close()
    started = time.monotonic()
    assert await adapter.abort("any") is False
    assert time.monotonic() - started < 3


async def test_openai_upstream_has_no_in_band_abort() -> None:
    assert await OpenAIUpstreamAdapter("m", "http://127.0.0.1:9/v1").abort("x") is False


# -- the scripted adapter ----------------------------------------------------------------------


def sleepy(request: ChatRequest) -> list[Step]:
    """One token, a long sleep, then a token and a normal end that an abort should cut off."""
    return [TextDelta("a"), TextDelta("bc", tokens=2), 5.0, TextDelta("d"), Finish("stop")]


async def test_scripted_abort_wakes_a_sleep_and_is_confirmed() -> None:
    adapter = ScriptedAdapter("m", sleepy)
    batches: list[list[Event]] = []
    stream = adapter.stream(chat(), "s-1")
    async with contextlib.aclosing(stream):
        batches.append(await anext(stream))
        batches.append(await anext(stream))
        sleeping = asyncio.create_task(anext(stream))
        await until(lambda: adapter.sleeping("s-1"), "the stream to sleep on its 5 s step")
        assert not sleeping.done()
        started = time.monotonic()
        assert await adapter.abort("s-1") is True
        assert await adapter.abort("s-1") is True  # idempotent while live
        batches.append(await asyncio.wait_for(sleeping, 1))
        woke_after = time.monotonic() - started
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
    [aborted] = batches[-1]
    assert type(aborted) is Aborted
    assert (aborted.index, aborted.completion_tokens, aborted.tail_tokens) == (0, 3, 0)
    assert 0 <= aborted.stop_latency_ms <= woke_after * 1000 < 1000
    assert adapter.aborted == {"s-1": True}
    assert adapter.abort_calls == ["s-1", "s-1"]
    assert await adapter.abort("s-1") is False  # no longer streaming


async def test_scripted_abort_between_steps_stops_at_the_next_one() -> None:
    adapter = ScriptedAdapter("m", text_script(["a", "b", "c", "d"]))
    batches = []
    async for batch in adapter.stream(chat(), "s-2"):
        batches.append(batch)
        if len(batches) == 2:
            assert await adapter.abort("s-2") is True
    assert batches[:2] == [[TextDelta("a")], [TextDelta("b")]]
    assert len(batches) == 3 and type(batches[2][0]) is Aborted
    assert batches[2][0].completion_tokens == 2
    assert adapter.aborted["s-2"] is True


async def test_scripted_not_abortable_says_false_and_runs_to_its_end() -> None:
    adapter = ScriptedAdapter("m", text_script(["a", "b"], delay=0.01), abortable=False)
    batches = []
    async for batch in adapter.stream(chat(), "s-3"):
        batches.append(batch)
        if len(batches) == 1:
            assert await adapter.abort("s-3") is False
    assert flat(batches) == [TextDelta("a"), TextDelta("b"), Finish("stop"), Usage(5, 2)]
    assert adapter.aborted == {"s-3": False}
    assert adapter.abort_calls == ["s-3"]


async def test_scripted_abort_of_an_id_not_streaming_is_false() -> None:
    adapter = ScriptedAdapter("m", text_script(["a"]))
    assert await adapter.abort("nobody") is False
    assert flat([b async for b in adapter.stream(chat(), "s-4")])[-1] == Usage(5, 1)
    assert await adapter.abort("s-4") is False  # finished
    assert adapter.aborted == {"s-4": False}


# -- the pool ----------------------------------------------------------------------------------


async def test_pool_routes_abort_to_the_member_streaming_the_request() -> None:
    slow = text_script(["x"] * 50, delay=0.02)
    first, second = ScriptedAdapter("m", slow), ScriptedAdapter("m", slow)
    pool = PoolAdapter([first, second])
    one, two = pool.stream(chat(), "p-1"), pool.stream(chat(), "p-2")
    async with contextlib.aclosing(one), contextlib.aclosing(two):
        await anext(one)  # p-1 goes to the first member
        await anext(two)  # p-2 to the second, which has fewer in flight
        assert await pool.abort("p-2") is True
        rest = flat([b async for b in two])
        assert await pool.abort("unknown") is False
    assert (first.abort_calls, second.abort_calls) == ([], ["p-2"])
    assert type(rest[-1]) is Aborted
    assert second.aborted == {"p-2": True}
    assert await pool.abort("p-2") is False  # its stream ended: forgotten
    assert second.abort_calls == ["p-2"]


# -- past the adapters ---------------------------------------------------------------------------


def test_admitted_and_aborted_are_not_chunks_nor_completion_content() -> None:
    renderer = ChunkRenderer("chatcmpl-1", "m", created=1)
    assert renderer.render(Admitted()) is None
    assert renderer.render(Aborted(0, 3, 1, 2.5)) is None
    builder = CompletionBuilder(1)
    for event in (Admitted(), TextDelta("hi"), Aborted(0, 1), Usage(2, 1)):
        builder.add(event)
    choice = orjson.loads(builder.build("chatcmpl-1", "m", 1))["choices"][0]
    assert choice["message"]["content"] == "hi"
