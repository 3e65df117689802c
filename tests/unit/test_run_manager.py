"""Following runs: replay from any event, live follow, and the disconnect grace window."""

from __future__ import annotations

import orjson
import pytest

from adapters.requests import ChatRequest, Message
from gateway.runs.manager import RunManager, new_run_id
from gateway.runs.spec import RunSpec
from gateway.runs.status import RunStatus
from gateway.state.run_store import ResumeWindowExpired
from gateway.state.run_store_memory import MemoryRunStore
from testkit.scripted_adapter import ScriptedAdapter, text_script

PIECES = [f"{i}:你好 " for i in range(30)]


def chat() -> ChatRequest:
    return ChatRequest("m", [Message("user", "hi")], stream=True)


async def start(manager: RunManager, adapter: ScriptedAdapter):
    return await manager.start(RunSpec(new_run_id(), chat(), adapter, "t"))


def text(events) -> str:
    out = []
    for event in events:
        body = orjson.loads(event[1])
        for choice in body.get("choices", []):
            out.append(choice["delta"].get("content") or "")
    return "".join(out)


async def collect(manager: RunManager, run_id: str, after: int = 0) -> list:
    return [e async for batch in manager.follow(run_id, after) for e in batch]


async def test_follow_replays_then_follows_live_until_the_end():
    manager = RunManager(MemoryRunStore())
    adapter = ScriptedAdapter("m", text_script(PIECES, delay=0.002))
    driver = await start(manager, adapter)
    events = await collect(manager, driver.run_id)
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert text(events) == "".join(PIECES)
    assert (await manager.result(driver.run_id)).status == RunStatus.COMPLETED


async def test_resuming_after_any_event_gives_exactly_the_rest():
    manager = RunManager(MemoryRunStore())
    driver = await start(manager, ScriptedAdapter("m", text_script(PIECES)))
    whole = await collect(manager, driver.run_id)
    for n in range(len(whole) + 1):
        head = [e for e in whole if e[0] <= n]
        assert head + await collect(manager, driver.run_id, after=n) == whole


async def test_events_past_retention_cannot_be_resumed():
    manager = RunManager(MemoryRunStore(max_events=8))
    driver = await start(manager, ScriptedAdapter("m", text_script(PIECES)))
    await manager.result(driver.run_id)
    with pytest.raises(ResumeWindowExpired):
        await collect(manager, driver.run_id, after=1)


async def test_last_follower_gone_cancels_after_the_grace_window():
    manager = RunManager(MemoryRunStore(), disconnect_grace=0.05)
    adapter = ScriptedAdapter("m", text_script(PIECES, delay=0.05))
    driver = await start(manager, adapter)
    await manager.attach(driver.run_id)
    await manager.attach(driver.run_id)
    await manager.detach(driver.run_id)  # one follower left: no grace window
    assert not manager.in_grace(driver.run_id) and driver.terminal is None
    await manager.detach(driver.run_id)
    assert manager.in_grace(driver.run_id)
    record = await manager.result(driver.run_id)
    assert (record.status, record.cause) == (RunStatus.CANCELLED, "cancel:disconnect")
    await driver.task
    assert adapter.aborted == {driver.run_id: True}
    assert not manager.drivers


async def test_a_follower_back_within_the_grace_window_keeps_the_run():
    manager = RunManager(MemoryRunStore(), disconnect_grace=0.1)
    adapter = ScriptedAdapter("m", text_script(PIECES[:6], delay=0.03))
    driver = await start(manager, adapter)
    await manager.attach(driver.run_id)
    await manager.detach(driver.run_id)
    assert manager.in_grace(driver.run_id)
    await manager.attach(driver.run_id)  # resumed in time
    assert not manager.in_grace(driver.run_id)
    record = await manager.result(driver.run_id)
    await manager.detach(driver.run_id)
    assert record.status == RunStatus.COMPLETED
    assert adapter.aborted == {driver.run_id: False}


async def test_the_last_follower_of_an_ended_run_leaves_without_a_grace_window():
    manager = RunManager(MemoryRunStore(), disconnect_grace=0.05)
    driver = await start(manager, ScriptedAdapter("m", text_script(PIECES[:3])))
    await manager.attach(driver.run_id)
    assert text(await collect(manager, driver.run_id)) == "".join(PIECES[:3])
    await driver.task
    await manager.detach(driver.run_id)  # how a stream that read to the end leaves
    assert not manager.in_grace(driver.run_id)


async def test_cancel_is_idempotent_and_a_no_op_once_ended():
    manager = RunManager(MemoryRunStore())
    driver = await start(manager, ScriptedAdapter("m", text_script(PIECES, delay=0.05)))
    await manager.cancel(driver.run_id, "client")
    await manager.cancel(driver.run_id, "disconnect")
    record = await manager.result(driver.run_id)
    await driver.task
    await manager.cancel(driver.run_id, "client")  # ended: nothing happens
    assert (record.status, record.cause) == (RunStatus.CANCELLED, "cancel:client")
    assert (await manager.get(driver.run_id)).terminal == record


async def test_close_ends_each_live_run_and_settles_it():
    manager = RunManager(MemoryRunStore())
    settled = []

    async def settle(outcome):
        settled.append(outcome)

    adapter = ScriptedAdapter("m", text_script(PIECES, delay=0.05))
    driver = await manager.start(RunSpec(new_run_id(), chat(), adapter, "t"), settle)
    await manager.store.wait(driver.run_id, 1)  # streaming
    await manager.close()  # the gateway shutting down, past any drain
    assert [(o.run_id, o.status, o.terminal.cause) for o in settled] == [
        (driver.run_id, RunStatus.FAILED, "shutdown")
    ]
    assert (await manager.store.get(driver.run_id)).terminal == settled[0].terminal
    assert adapter.aborted == {driver.run_id: True}
    assert manager.drivers == {}
