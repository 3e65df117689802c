"""The run driver over a scripted upstream and the in-process store: every terminal path writes
its last event, reaches exactly one terminal state, and closes the upstream stream."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from adapters.base import BackendFailed
from adapters.events import ErrorEvent, Finish, TextDelta, Usage
from adapters.requests import ChatRequest, Message
from adapters.scripted import ScriptedAdapter, text_script
from gateway.runs.driver import Deadlines, RunDriver
from gateway.runs.state import RunStatus
from gateway.runs.store import RunRecord
from gateway.runs.store_memory import MemoryRunStore


async def make_driver(script, deadlines: Deadlines | None = None, **chat):
    store = MemoryRunStore()
    adapter = ScriptedAdapter("m", script)
    await store.create(RunRecord("run-1", "t", "m", 0.0))
    request = ChatRequest("m", [Message("user", "hi")], stream=True, **chat)
    return store, adapter, RunDriver(store, adapter, "run-1", request, deadlines or Deadlines())


async def log(store) -> list[dict]:
    return [orjson.loads(p) for _, p in await store.read("run-1", 0)]


def texts(events: list[dict]) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in events if "choices" in e for c in e["choices"]
    )


async def test_a_completed_run_logs_every_chunk_and_its_object():
    store, adapter, driver = await make_driver(text_script(["a", "b", "c"]), include_usage=True)
    record = await driver.start()
    events = await log(store)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert texts(events) == "abc"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert record.status == RunStatus.COMPLETED and record.finish_reason == "stop"
    assert record.completion["choices"][0]["message"]["content"] == "abc"
    assert (await store.get("run-1")).status == RunStatus.COMPLETED
    assert adapter.aborted == {"run-1": False}


async def test_cancel_mid_stream_ends_cancelled_and_closes_the_upstream():
    store, adapter, driver = await make_driver(
        text_script([f"t{i}" for i in range(100)], delay=0.01)
    )
    task = driver.start()
    await asyncio.sleep(0.05)
    driver.cancel("client")
    driver.cancel("disconnect")  # idempotent: the first source stands
    record = await task
    assert (record.status, record.cause) == (RunStatus.CANCELLED, "cancel:client")
    assert (await log(store))[-1]["error"]["code"] == "cancelled"
    assert adapter.aborted == {"run-1": True}


@pytest.mark.parametrize(
    ("script", "deadlines", "cause"),
    [
        (lambda r: [1.0, TextDelta("late")], Deadlines(ttft=0.05), "deadline:ttft"),
        (
            lambda r: [TextDelta("a"), 1.0, TextDelta("b")],
            Deadlines(inter_token=0.05),
            "deadline:inter_token",
        ),
        (
            text_script(["x"] * 100, delay=0.01),
            Deadlines(total=0.1, inter_token=5),
            "deadline:total",
        ),
    ],
)
async def test_each_deadline_is_its_own_cause(script, deadlines, cause):
    store, adapter, driver = await make_driver(script, deadlines)
    record = await driver.start()
    assert (record.status, record.cause) == (RunStatus.TIMED_OUT, cause)
    assert (await log(store))[-1]["error"]["code"] == "timeout"
    assert adapter.aborted == {"run-1": True}


async def test_an_upstream_error_event_fails_the_run():
    store, _, driver = await make_driver(
        lambda r: [TextDelta("a"), ErrorEvent("worker_error", "x"), TextDelta("never")]
    )
    record = await driver.start()
    assert (record.status, record.cause) == (RunStatus.FAILED, "worker_error")
    events = await log(store)
    assert texts(events) == "a"
    assert events[-1]["error"]["code"] == "upstream_error"


async def test_a_backend_exception_fails_the_run():
    store, _, driver = await make_driver(lambda r: [TextDelta("a"), BackendFailed("gone")])
    record = await driver.start()
    assert record.status == RunStatus.FAILED
    assert (await log(store))[-1]["error"]["code"] == "upstream_error"


async def test_cancel_racing_completion_gives_one_terminal_state():
    for delay in (0.0, 0.001, 0.005):
        store, _, driver = await make_driver(
            lambda r: [TextDelta("a"), Finish("stop"), Usage(1, 1)]
        )
        task = driver.start()
        await asyncio.sleep(delay)
        driver.cancel("client")
        record = await task
        stored = await store.get("run-1")
        assert stored.terminal == record
        assert record.status in (RunStatus.COMPLETED, RunStatus.CANCELLED)
        errors = [e for e in await log(store) if "error" in e]
        assert len(errors) == (record.status == RunStatus.CANCELLED)
