"""Slow clients (design §3): a client that stops reading is detached without the gateway
buffering the run for it, and the run goes on; a client that falls behind and catches up gets
its text coalesced, never lost; a client that keeps up gets every event as it is.

The slow clients are raw sockets with a small receive buffer, so the test decides exactly when
bytes are taken off the wire."""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
from collections.abc import Iterator

import orjson
import psutil
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from adapters.chat_chunks import ChunkRenderer
from adapters.events import Finish, TextDelta, ToolCallDelta, Usage
from gateway.app_keys import RUNS
from gateway.http.backpressure import COALESCE_AT, coalesce
from gateway.http.sse import SlowClient, SSEWriter
from gateway.runs.endings import ending
from gateway.runs.status import RunStatus
from gateway.state.run_store import Chunk, ResumeWindowExpired, log_chunk
from testkit.scripted_adapter import ScriptedAdapter
from tests.support.gateway import (
    API_KEY,
    AUTH,
    chat_body,
    gateway_app,
    sse_events,
    stream_payloads,
    stream_text,
)
from tests.support.loops import ON_EITHER_LOOP
from tests.support.waiting import until

# 100 distinct pieces of 50 bytes each, cycled: the run's text is easy to rebuild and to check
PIECES = [f"{i:02d}: café, naïve — the quick brown fox jumps!! " for i in range(100)]
assert {len(p.encode()) for p in PIECES} == {50}
SEND_BUFFER = 8192


def flood(count: int):
    """A script: `count` text pieces as fast as the loop allows (it yields between pieces)."""

    def script(request) -> Iterator:
        for i in range(count):
            yield TextDelta(PIECES[i % len(PIECES)])
            yield 0.0  # let the gateway's other tasks run: the follower, the HTTP writes
        yield Finish("stop")
        yield Usage(5, count)

    return script


def full_text(count: int) -> str:
    return "".join(PIECES[i % len(PIECES)] for i in range(count))


async def small_send_buffer(request, response) -> None:
    """Pin the server's socket send buffer small (the kernel would otherwise grow it to
    megabytes), so a client that stops reading blocks the gateway's writes early, on any host."""
    sock = request.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)


async def make_client(aiohttp_client, script, **settings):
    app = gateway_app(adapters=[ScriptedAdapter("scripted", script)], **settings)
    app.on_response_prepare.append(small_send_buffer)
    return await aiohttp_client(app)


async def open_raw_stream(client, rcvbuf: int = 4096):
    """A hand-written HTTP/1.1 streaming POST from a socket with a small receive buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (client.host, client.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
    body = orjson.dumps(chat_body(stream=True))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"Host: %s:%d\r\n"
        b"Authorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n"
        b"Connection: close\r\n"
        b"\r\n%s" % (client.host.encode(), client.port, API_KEY.encode(), len(body), body)
    )
    await writer.drain()
    return reader, writer


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        assert body[end + 2 + size : end + 4 + size] == b"\r\n"
        pos = end + 4 + size


async def metric_samples(client) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


async def metrics_once(client, name: str) -> dict[str, float]:
    """The metrics, as soon as `name` is non-zero (the handler counts after the client left)."""

    async def counted() -> dict[str, float] | None:
        metrics = await metric_samples(client)
        return metrics if metrics.get(name) else None

    return await until(counted, f"{name} to be counted")


@ON_EITHER_LOOP
async def test_a_client_that_stops_reading_is_detached_and_the_run_completes(aiohttp_client):
    count, ring = 20_000, 256
    client = await make_client(
        aiohttp_client,
        flood(count),
        run_max_events=ring,
        slow_client_timeout=0.5,
        disconnect_grace=60,
    )
    store = client.app[RUNS].store
    process = psutil.Process()
    reader, writer = await open_raw_stream(client)
    head = await reader.readuntil(b'","object"')  # headers and the start of the first event
    assert head.startswith(b"HTTP/1.1 200")
    run_id = re.search(rb'"id":"(chatcmpl-[0-9a-f]+)', head).group(1).decode()
    writer.transport.pause_reading()  # from here on, the client takes nothing

    # NOTE: memory is measured from the moment the ring is full: by then the path's own working
    # set (buffers, pages the allocator had handed back to the OS) is in, and what grows after
    # it would grow with what the run produces
    baseline = peak = from_seq = samples = 0
    while not (record := await store.get(run_id)).status.is_terminal:
        if record.last_seq > ring + 1:  # the log keeps exactly the last `ring` events
            rss = process.memory_info().rss
            if not baseline:
                baseline, from_seq = rss, record.last_seq
            peak = max(peak, rss)
            assert len(await store.read(run_id, record.last_seq - ring)) == ring
            with pytest.raises(ResumeWindowExpired):
                await store.read(run_id, record.last_seq - ring - 1)
            samples += 1
        await asyncio.sleep(0.01)  # NOTE: sampling memory and the log while the run goes on
    assert samples > 10

    resp = await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)
    done = await resp.json()
    assert done["status"] == "completed"
    assert done["choices"][0]["message"]["content"] == full_text(count)
    assert done["usage"]["completion_tokens"] == count
    # what the stream would have carried, had the client read it: far more than memory grew
    frame = b"id: 12345\ndata: %b\n\n" % ChunkRenderer(run_id, "scripted").render(
        TextDelta(PIECES[0])
    )
    assert from_seq < count // 2, "most of the run is left to measure"
    produced = (count - from_seq) * len(frame)
    assert peak - baseline < produced / 4, (peak - baseline, produced)

    metrics = await metrics_once(client, "sluice_slow_client_detaches_total")
    assert metrics["sluice_slow_client_detaches_total"] == 1
    assert metrics["sluice_disconnects_total"] == 1
    assert metrics["sluice_client_blocked_seconds_count"] >= 1
    # the wait that ended it counts: the 0.5 s timeout, give or take uvloop's timers, which
    # keep whole milliseconds of the loop's own clock and may fire a fraction of one early
    assert metrics["sluice_client_blocked_seconds_sum"] >= 0.5 - 0.001
    assert metrics["sluice_active_streams"] == 0
    writer.close()


async def read_slowly_then_all(reader, slow_bytes: int, step: int = 2048, pause: float = 0.01):
    """Take `step` bytes at a time with a pause between, until `slow_bytes`; then the rest."""
    raw = b""
    while len(raw) < slow_bytes:
        piece = await reader.read(step)
        assert piece, "the response ended while the client was still reading slowly"
        raw += piece
        await asyncio.sleep(pause)  # NOTE: the scenario: a client that reads slowly
    return raw + await reader.read()


@ON_EITHER_LOOP
async def test_a_client_that_falls_behind_gets_merged_text_and_nothing_lost(aiohttp_client):
    count = 3_000  # fewer events than the log keeps: falling behind can never expire the stream
    client = await make_client(aiohttp_client, flood(count), disconnect_grace=60)
    reader, writer = await open_raw_stream(client)
    raw = await read_slowly_then_all(reader, slow_bytes=100_000)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    events = sse_events(dechunk(body))
    assert events[-1].data == "[DONE]"
    ids = [int(e.id) for e in events[:-1]]
    assert ids[0] == 1 and ids[-1] == count + 2  # role, the pieces, finish
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert len(ids) < count + 2  # the backlog was merged
    payloads = stream_payloads(dechunk(body))[:-1]
    assert stream_text(payloads) == full_text(count)  # …and no text was lost
    assert max(len(p["choices"][0]["delta"].get("content") or "") for p in payloads) > 50
    deltas = [p["choices"][0]["delta"] for p in payloads]
    finishes = [p["choices"][0]["finish_reason"] for p in payloads]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert sum("role" in d for d in deltas) == 1
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert all(set(d) == {"content"} for d in deltas[1:-1])  # no error frame in between
    metrics = await metric_samples(client)
    assert metrics["sluice_slow_client_detaches_total"] == 0
    assert metrics["sluice_client_blocked_seconds_sum"] > 0


@ON_EITHER_LOOP
async def test_a_client_that_keeps_up_gets_every_event_even_from_a_burst(aiohttp_client):
    burst = [TextDelta(f"{i} ") for i in range(4 * COALESCE_AT)]
    client = await make_client(
        aiohttp_client, lambda r: [TextDelta("a"), 0.05, burst, Finish("stop"), Usage(1, 65)]
    )
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    raw = await resp.read()
    events = sse_events(raw)
    ids = [int(e.id) for e in events[:-1]]
    assert ids == list(range(1, len(burst) + 4))  # role, "a", the burst, finish: none merged
    assert stream_text(stream_payloads(raw)) == "a" + "".join(d.text for d in burst)


@ON_EITHER_LOOP
async def test_a_client_that_keeps_up_is_written_by_the_driver_without_log_reads(aiohttp_client):
    count = 400
    app = gateway_app(adapters=[ScriptedAdapter("scripted", flood(count))])
    client = await aiohttp_client(app)
    store = client.app[RUNS].store
    reads = 0
    read = store.read

    async def counted_read(*args, **kwargs):
        nonlocal reads
        reads += 1
        return await read(*args, **kwargs)

    store.read = counted_read
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    raw = await resp.read()
    assert stream_text(stream_payloads(raw)) == full_text(count)
    ids = [int(e.id) for e in sse_events(raw)[:-1]]
    assert ids == list(range(1, count + 3))  # role, every piece, finish: in order, none twice
    # NOTE: a stream woken per batch would read the log once per piece; the driver wrote them
    assert reads < count // 4, reads


class _PausedTransport:
    """A socket whose writing is paused with 30 KiB still queued: past the low-water mark, under
    the high one. asyncio resumes a paused writer only once its buffer falls to the low-water
    mark, so a writer paused earlier stays paused here."""

    def get_write_buffer_size(self) -> int:
        return 30 * 1024

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 * 1024, 64 * 1024

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        assert (low, high) == self.get_write_buffer_limits()  # the writer's marks are these

    def is_closing(self) -> bool:
        return False


class _DrainingForever:
    """A response whose write waits for the paused socket to drain, which never happens."""

    async def write(self, body: bytes) -> None:
        await asyncio.Event().wait()


@ON_EITHER_LOOP
async def test_a_writer_sets_its_marks_on_a_live_connection_and_leaves_a_closed_one_alone():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    async with server:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        SSEWriter(web.StreamResponse(), ping_interval=0, transport=writer.transport)
        assert writer.transport.get_write_buffer_limits() == (16 * 1024, 64 * 1024)
        writer.close()
        await writer.wait_closed()
        # a client gone before its stream's writer was made: nothing to set (uvloop refuses)
        SSEWriter(web.StreamResponse(), ping_interval=0, transport=writer.transport)


@ON_EITHER_LOOP
async def test_a_write_to_a_paused_socket_is_timed_out_even_under_the_high_water_mark():
    writer = SSEWriter(
        _DrainingForever(), ping_interval=0, write_timeout=0.2, transport=_PausedTransport()
    )
    async with asyncio.timeout(5):  # the bug this guards against is a write that never ends
        with pytest.raises(SlowClient):
            await writer.send([(1, b"{}", None, 0)])
    assert writer.blocked >= 0.2 - 0.001  # as above: uvloop's timers keep whole milliseconds


# -- coalesce, on its own -----------------------------------------------------------------------

R = ChunkRenderer("chatcmpl-test", "scripted", created=1)


def text(piece: str, index: int = 0) -> Chunk:
    """A plain text delta as the run's pipeline puts it in the log: its chunk and its text."""
    return log_chunk(R.render(TextDelta(piece, index=index)), piece, index)


def numbered(chunks: list[Chunk]) -> list[tuple]:
    """The chunks as the log reads them back: (seq, payload, text, index)."""
    return [(seq, *chunk) for seq, chunk in enumerate(chunks, start=1)]


def content(chunk: Chunk) -> tuple[int, str]:
    (choice,) = orjson.loads(chunk[0])["choices"]
    return choice["index"], choice["delta"]["content"]


def test_a_short_backlog_is_left_as_it_is():
    events = numbered([text(f"{i}") for i in range(COALESCE_AT - 1)])
    assert coalesce(events, R) == events


def test_a_long_backlog_merges_runs_of_plain_text_of_one_choice_and_keeps_the_rest():
    usage = log_chunk(R.usage(Usage(3, 30)))
    error = ending(RunStatus.CANCELLED, "cancel:client")[1]
    tool = log_chunk(R.render(ToolCallDelta(0, '{"city": ', id="call_1", name="weather")))
    lp = [{"token": "lp", "logprob": -0.5}]
    with_logprobs = log_chunk(R.render(TextDelta("lp", logprobs=lp)))  # no text: not mergeable
    payloads = [
        log_chunk(R.role(0)),  # 1
        *[text(f"a{i} ") for i in range(10)],  # 2..11
        text("b0 ", index=1),  # 12: another choice
        text("a10 "),  # 13
        text("a11 "),  # 14
        tool,  # 15
        text("a12 "),  # 16
        with_logprobs,  # 17: text with logprobs is not plain text
        text("a13 "),  # 18
        text("b1 ", index=1),  # 19
        text("b2 ", index=1),  # 20
        log_chunk(R.render(Finish("stop"))),  # 21
        usage,  # 22
        error,  # 23
    ]
    events = numbered(payloads)
    assert len(events) >= COALESCE_AT
    out = coalesce(events, R)
    assert [e[0] for e in out] == [1, 11, 12, 14, 15, 16, 17, 18, 20, 21, 22, 23]
    merged = {e[0]: e[1:] for e in out}  # seq -> the chunk
    assert content(merged[11]) == (0, "".join(f"a{i} " for i in range(10)))
    assert content(merged[14]) == (0, "a10 a11 ")
    assert content(merged[20]) == (1, "b1 b2 ")
    for seq in (1, 12, 15, 16, 17, 18, 21, 22, 23):  # alone or not plain text: as they were
        assert merged[seq] == payloads[seq - 1]  # byte for byte
    assert orjson.loads(merged[11][0])["id"] == "chatcmpl-test"  # still a whole chunk
    assert merged[11][0] == text("".join(f"a{i} " for i in range(10)))[0]


def test_merging_never_changes_the_text_of_any_choice():
    payloads = [text(f"{i}é", index=i % 3 // 2) for i in range(50)]
    out = coalesce(numbered(payloads), R)
    assert len(out) < len(payloads)
    for index in (0, 1):
        before = "".join(c for i, c in map(content, payloads) if i == index)
        after = "".join(c for i, c in (content(e[1:]) for e in out) if i == index)
        assert after == before
