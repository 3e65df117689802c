"""The engine loop thread seen from asyncio: streams, aborts on cancel/close, idle, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from tests.support.loops import WORKERS_LOOP
from tests.support.waiting import until
from wire.sampling_params import SamplingParams
from workers.async_engine import AsyncEngine, DuplicateRequest
from workers.engine import Engine
from workers.request import EngineRequest

EVENT_LOOP = WORKERS_LOOP  # the loop these tests run on


@pytest.fixture
async def engine(tiny) -> AsyncIterator[AsyncEngine]:
    model, tokenizer = tiny
    async_engine = AsyncEngine(Engine(model, tokenizer))
    async_engine.start()
    yield async_engine
    await async_engine.stop()


def request(request_id: str, max_tokens: int = 8, **params) -> EngineRequest:
    """ignore_eos: a sampled run on the tiny model may draw EOS; these runs must stay long."""
    params = {"max_tokens": max_tokens, "ignore_eos": True, **params}
    return EngineRequest(request_id, [5, 6, 7], SamplingParams(**params))


async def wait_idle(engine: AsyncEngine) -> None:
    stats = engine.stats
    await until(lambda: not (stats().running or stats().waiting), "the engine to go idle")


async def test_a_stream_is_start_admitted_text_finish_usage(engine: AsyncEngine) -> None:
    events = [e.wire() async for e in engine.generate(request("r", temperature=0.0))]
    assert events[0] == {"type": "start", "prompt_tokens": 3}
    assert events[1] == {"type": "admitted"}
    assert {e["type"] for e in events[2:-2]} == {"text"}
    assert events[-2] == {"type": "finish", "index": 0, "reason": "length", "completion_tokens": 8}
    assert events[-1] == {"type": "usage", "prompt_tokens": 3, "completion_tokens": 8}


async def test_cancelling_the_consumer_aborts_the_request(engine: AsyncEngine) -> None:
    first_text = asyncio.Event()

    async def consume() -> None:
        async for line in engine.generate(request("long", max_tokens=1000)):
            if line.type == "text":
                first_text.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_text.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    generated = engine.stats().generated_tokens_total
    assert generated < 1000
    await asyncio.sleep(0.1)  # NOTE: an absence is only seen over time: no step after the abort
    assert engine.stats().generated_tokens_total == generated


async def test_closing_the_stream_early_aborts_the_request(engine: AsyncEngine) -> None:
    stream = engine.generate(request("long", max_tokens=1000))
    async with contextlib.aclosing(stream):
        async for line in stream:
            if line.type == "text":
                break
    await wait_idle(engine)
    assert engine.stats().generated_tokens_total < 1000
    assert engine.abort("long") is False


async def test_abort_by_id_ends_the_stream_with_abort(engine: AsyncEngine) -> None:
    events = []
    async for line in engine.generate(request("r", max_tokens=1000)):
        events.append(line.wire())
        if line.type == "text" and len(events) == 3:
            assert engine.abort("r") is True
    finish, usage = events[-2:]
    assert (finish["type"], finish["reason"]) == ("finish", "abort")
    assert usage == {
        "type": "usage",
        "prompt_tokens": 3,
        "completion_tokens": finish["completion_tokens"],
    }
    assert finish["completion_tokens"] < 1000
    assert engine.abort("r") is False


async def test_a_live_request_id_cannot_be_reused(engine: AsyncEngine) -> None:
    first = engine.generate(request("dup", max_tokens=1000))
    async with contextlib.aclosing(first):
        await anext(first)
        second = engine.generate(request("dup"))
        with pytest.raises(DuplicateRequest):
            await anext(second)


async def test_an_id_closed_early_is_free_again_once_the_engine_let_go(
    engine: AsyncEngine,
) -> None:
    first = engine.generate(request("again", max_tokens=1000))
    async with contextlib.aclosing(first):
        while (await anext(first)).type != "text":
            pass
    # its abort takes effect at the next step; until then the id is still the engine's
    await until(lambda: not engine.holds("again"), "the engine to let go of the request")
    lines = [line.wire() async for line in engine.generate(request("again", max_tokens=3))]
    assert lines[-1] == {"type": "usage", "prompt_tokens": 3, "completion_tokens": 3}


async def test_the_idle_thread_sleeps(engine: AsyncEngine) -> None:
    await wait_idle(engine)
    # NOTE: what is measured is CPU over a stretch of wall time, so the test waits it out
    await asyncio.sleep(0.2)  # NOTE: OpenMP workers finish their post-op spin first
    started = time.process_time()
    await asyncio.sleep(0.5)  # NOTE: the stretch whose CPU is measured
    assert time.process_time() - started < 0.05


async def test_stop_ends_live_streams_with_an_error(tiny) -> None:
    model, tokenizer = tiny
    engine = AsyncEngine(Engine(model, tokenizer))
    engine.start()
    events = []
    streaming = asyncio.Event()

    async def consume() -> None:
        async for line in engine.generate(request("r", max_tokens=1000)):
            events.append(line.wire())
            if line.type == "text":
                streaming.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(streaming.wait(), 5)
    await engine.stop()
    await asyncio.wait_for(task, 5)
    assert events[-1] == {
        "type": "error",
        "code": "shutting_down",
        "message": "the worker is shutting down",
    }
    assert not engine.is_running
