"""An ended run's packed log reads back exactly the events the live log held: sequence numbers,
payload bytes, texts (None, empty, non-ASCII) and choice indexes, from any point."""

from __future__ import annotations

import gc

import pytest

from gateway.runs.status import RunStatus
from gateway.state.compact_log import CompactLog
from gateway.state.run_store import ResumeWindowExpired, RunRecord, TerminalRecord, log_chunk
from gateway.state.run_store_memory import MemoryRunStore

ENDING = TerminalRecord(RunStatus.COMPLETED, "completed", "stop")


def make_events(first_seq: int = 1) -> list:
    """A role chunk, text deltas on two choices (one empty, one not ASCII), a tool-call chunk."""
    return [
        (first_seq, b'{"role":"assistant"}', None, 0),
        (first_seq + 1, b'{"content":"Hel"}', "Hel", 0),
        (first_seq + 2, b'{"content":""}', "", 1),
        (first_seq + 3, '{"content":"lö ☃"}'.encode(), "lö ☃", 1),
        (first_seq + 4, b'{"tool_calls":[]}', None, 0),
        (first_seq + 5, b"", "x", 3),
    ]


def test_packing_round_trips_every_event():
    events = make_events(first_seq=7)
    packed = CompactLog.pack(events)
    assert len(packed) == len(events)
    assert list(packed) == events
    assert packed.last_seq == 12
    for start in range(len(events) + 1):
        for stop in range(start, len(events) + 2):
            assert packed.slice(start, stop) == events[start:stop]


def test_an_empty_log_packs_to_nothing():
    packed = CompactLog.pack([])
    assert len(packed) == 0 and list(packed) == [] and packed.size == 0


def test_positions_past_either_end_read_nothing_there():
    packed = CompactLog.pack(make_events())
    assert packed.slice(6, 100) == [] and packed.slice(-3, 1) == make_events()[:1]


def test_a_gap_in_sequence_numbers_is_refused():
    events = make_events()
    with pytest.raises(ValueError, match="does not follow"):
        CompactLog.pack([events[0], events[2]])


def test_a_packed_log_is_untracked_buffers_smaller_than_its_payloads():
    chunk = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"delta":{"content":'
    events = [(seq, chunk + b'"tok%d "}}]}' % seq, f"tok{seq} ", 0) for seq in range(1, 65)]
    packed = CompactLog.pack(events)
    assert list(packed) == events
    assert not any(gc.is_tracked(b) for b in (packed.packed, packed.texts))
    assert packed.size < sum(len(e[1]) for e in events) / 4


async def ended_run(store: MemoryRunStore, chunks: list) -> str:
    await store.create(RunRecord("run-1", tenant="t", model="m", created=0.0))
    await store.append("run-1", chunks[:-1])
    await store.finish("run-1", ENDING, chunks[-1])
    return "run-1"


async def test_resuming_an_ended_run_from_any_id_reads_what_the_live_run_held():
    chunks = [log_chunk(e[1], e[2], e[3]) for e in make_events()]
    live = MemoryRunStore()
    await live.create(RunRecord("run-1", tenant="t", model="m", created=0.0))
    await live.append("run-1", chunks)
    held = {after: await live.read("run-1", after) for after in range(8)}
    store = MemoryRunStore()
    run = await ended_run(store, chunks)
    assert isinstance(store.snapshot(run)[1], list) and store.snapshot(run)[1] == held[0]
    for after in range(8):
        assert await store.read(run, after) == held[after]
        assert await store.read(run, after, limit=2) == held[after][:2]


async def test_an_ended_run_keeps_its_retention_window():
    store = MemoryRunStore(max_events=3)
    run = await ended_run(store, [log_chunk(b"%d" % i) for i in range(1, 8)])  # keeps 5..7
    with pytest.raises(ResumeWindowExpired):
        await store.read(run, 3)
    assert [e[0] for e in await store.read(run, 4)] == [5, 6, 7]
    assert await store.read(run, 7) == []
    assert (await store.get(run)).last_seq == 7


async def test_ended_runs_count_their_packed_bytes():
    store = MemoryRunStore()
    await ended_run(store, [log_chunk(b"x" * 1000, "t", 0)] * 10)
    assert 0 < store.ended_bytes < 1000  # the live log counted 10 x (1,000 + 120)
    store.discard("run-1")
    assert store.ended_bytes == 0


async def test_a_followed_run_is_packed_when_its_last_follower_leaves_not_before():
    """The run's own streams read its last events right after the ending: from the live log,
    which is packed (and its bytes recounted) once the last of them has gone."""
    store = MemoryRunStore()
    chunks = [log_chunk(b"x" * 1000, "t", 0)] * 10
    await store.create(RunRecord("run-1", tenant="t", model="m", created=0.0))
    await store.add_follower("run-1", 2)
    await store.append("run-1", chunks[:-1])
    await store.finish("run-1", ENDING, chunks[-1])
    live = 10 * (1000 + 120) + ENDING.size
    assert store.ended_bytes == store.bytes_held() == live  # still the live log
    tail = await store.read("run-1", 8)
    await store.add_follower("run-1", -1)
    assert store.ended_bytes == live  # one reader is left
    await store.add_follower("run-1", -1)
    assert 0 < store.ended_bytes == store.bytes_held() < 1000 + ENDING.size
    assert await store.read("run-1", 8) == tail and [e[0] for e in tail] == [9, 10]
    store.discard("run-1")
    assert store.ended_bytes == 0
