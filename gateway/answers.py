"""Answering from a run: follow its event log as an SSE stream, or wait for its final object.

Both the request that started a run and a later resume go through `stream_run`; the request
counts as one of the run's followers while it reads, so a dropped connection starts the run's
disconnect grace window instead of stopping it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson
import structlog
from aiohttp import web

from adapters.requests import ChatRequest
from adapters.to_openai import ChunkRenderer, completion_chunks
from gateway.app_keys import METRICS, OPEN_STREAMS, RUNS, SETTINGS
from gateway.backpressure import coalesce
from gateway.errors import internal_error, terminal_error
from gateway.run_life import Opened
from gateway.runs.endings import store_unavailable_error
from gateway.runs.manager import RunManager
from gateway.runs.status import RunStatus
from gateway.runs.store import (
    LogEvents,
    ResumeWindowExpired,
    RunRecord,
    StoreUnavailable,
    TerminalRecord,
    UnknownRun,
)
from gateway.sse import SlowClient, SSEWriter

log = structlog.get_logger("sluice.streaming")
FOLLOW_BATCH = 512  # most events read from the log at once


async def answer(request: web.Request, opened: Opened, chat: ChatRequest) -> web.StreamResponse:
    """The answer to the request that opened a run (or repeated one): its stream, its object,
    or, for a run no longer kept, what it answered."""
    if opened.ending is not None:
        return await respond_with_ending(
            request, opened.ending, chat.stream, chat.include_usage, opened.headers
        )
    if chat.stream:
        record = await request.app[RUNS].get(opened.run_id)
        return await stream_run(request, record, headers=opened.headers or None)
    return await respond_with_result(request, opened.run_id, opened.headers or None)


@contextlib.asynccontextmanager
async def following(runs: RunManager, run_id: str) -> AsyncIterator[None]:
    """Count this request as a follower of the run while inside, however it leaves."""
    attach = asyncio.ensure_future(runs.attach(run_id))
    try:
        await asyncio.shield(attach)
        yield
    finally:
        await asyncio.shield(_detach_after(runs, attach, run_id))


async def _detach_after(runs: RunManager, attach: asyncio.Future[None], run_id: str) -> None:
    with contextlib.suppress(Exception):
        await attach
    # NOTE: a count this replica cannot write now is corrected by its next write for the run
    # (each replica's count is absolute); the stream must end cleanly all the same.
    with contextlib.suppress(StoreUnavailable, UnknownRun):
        await runs.detach(run_id)


async def stream_run(
    request: web.Request,
    record: RunRecord,
    after: int = 0,
    headers: dict[str, str] | None = None,
    *,
    resume: bool = False,
) -> web.StreamResponse:
    """Events after `after`, then the live run, as SSE. A resume raises ResumeWindowExpired
    (before anything is sent) when `after` is no longer retained; the request that started the
    run gets its HTTP error instead of a stream when the run was refused before any event."""
    metrics = request.app[METRICS]
    begun: list[SSEWriter] = []  # the stream's writer, once its headers are out
    try:
        await _follow(request, record, after, headers, resume, begun)
    except SlowClient:
        metrics.slow_clients.inc()
        metrics.disconnects.inc()
        if request.transport is not None:
            request.transport.abort()  # the grace window now applies, as to any disconnect
    except ConnectionError:
        # the client went away while a frame was being written: an expected disconnect (the
        # grace window applies), not a server error to log with its traceback
        metrics.disconnects.inc()
    except asyncio.CancelledError:
        metrics.disconnects.inc()
        raise
    return begun[0].response if begun else web.Response(status=499)


async def _follow(
    request: web.Request,
    record: RunRecord,
    after: int,
    headers: dict[str, str] | None,
    resume: bool,
    begun: list[SSEWriter],
) -> None:
    app = request.app
    runs, metrics, settings = app[RUNS], app[METRICS], app[SETTINGS]
    run_id = record.run_id
    renderer = ChunkRenderer(run_id, record.model, int(record.created))  # to merge text
    async with (
        following(runs, run_id),
        contextlib.aclosing(runs.follow(run_id, after, FOLLOW_BATCH)) as events,
    ):
        # NOTE: the answer waits for the run's first events (so that a run refused before any,
        # a 400 from the worker say, is still a plain HTTP error), but only up to one heartbeat
        # interval: a run stuck in a queue gets its headers and pings meanwhile.
        first_read = asyncio.ensure_future(anext(events, None))
        try:
            first, outran = await _first_events(first_read, settings.ping_interval, resume)
            if first is None and not outran and first_read.done():
                terminal = (await runs.get(run_id)).terminal
                if terminal is not None and terminal.refused:
                    raise terminal_error(terminal)
            writer = await SSEWriter.open(
                request,
                settings.ping_interval,
                headers,
                first=first,
                write_timeout=settings.slow_client_timeout or None,
            )
            begun.append(writer)
            app[OPEN_STREAMS].add(asyncio.current_task())
            metrics.active_streams.inc()
            try:
                if outran:
                    await _fell_behind(writer)
                else:
                    pending = None if first_read.done() else first_read
                    await _relay(events, writer, renderer, pending)
            finally:
                metrics.active_streams.dec()
                metrics.client_blocked.observe(writer.blocked)
        finally:
            if not first_read.done():  # its task must end before the log is closed
                first_read.cancel()
                await asyncio.wait([first_read])


async def _first_events(
    read: asyncio.Future[LogEvents | None], wait: float, resume: bool
) -> tuple[LogEvents | None, bool]:
    """(the first events, or None if none came within `wait`; whether the run outran its log
    before this request read it). A resume raises ResumeWindowExpired instead."""
    try:
        async with asyncio.timeout(wait or None):
            return await asyncio.shield(read), False
    except TimeoutError:
        return None, False
    except ResumeWindowExpired:
        if resume:
            raise
        return None, True


async def _relay(
    events: AsyncIterator[LogEvents],
    writer: SSEWriter,
    renderer: ChunkRenderer,
    first_read: asyncio.Future[LogEvents | None] | None = None,
) -> None:
    """Send everything until the run's log ends; `first_read` is a first read still pending."""
    try:
        if first_read is not None:
            batch = await first_read
            if batch is None:
                await writer.close()
                return
            await writer.send(batch)
        async for batch in events:
            # NOTE: only a client whose last write waited has a backlog to merge; a long read
            # for one that keeps up (an upstream burst, a replay) goes out event by event.
            await writer.send(coalesce(batch, renderer) if writer.behind else batch)
    except ResumeWindowExpired:  # so far behind that the log moved past it
        await _fell_behind(writer)
        return
    except (ConnectionError, asyncio.CancelledError):
        writer.abandon()
        raise
    except StoreUnavailable:  # away for longer than the outage grace
        await writer.send_error(store_unavailable_error())
    except Exception as exc:  # begun: the stream ends with an error frame, never a second body
        log.error("stream failed", last_seq=writer.last_seq, error=type(exc).__name__)
        await writer.send_error(internal_error().body()["error"])
    await writer.close()


async def _fell_behind(writer: SSEWriter) -> None:
    """End a stream whose next events the log no longer holds."""
    await writer.send_error(
        {
            "message": "This stream fell behind the events the server keeps; "
            f"resume with starting_after={writer.last_seq} is no longer possible.",
            "type": "invalid_request_error",
            "param": None,
            "code": "resume_window_expired",
        }
    )
    await writer.close()


async def respond_with_result(
    request: web.Request, run_id: str, headers: dict[str, str] | None = None
) -> web.Response:
    """Wait for the run's end and answer with its `chat.completion` (or its error)."""
    runs = request.app[RUNS]
    try:
        async with following(runs, run_id):
            terminal = await runs.result(run_id)
    except asyncio.CancelledError:
        request.app[METRICS].disconnects.inc()
        raise
    if terminal.status is RunStatus.COMPLETED and terminal.completion is not None:
        return web.Response(
            body=terminal.completion, content_type="application/json", headers=headers
        )
    error = terminal_error(terminal)
    error.headers.update(headers or {})
    raise error


async def respond_with_ending(
    request: web.Request,
    terminal: TerminalRecord,
    stream: bool,
    include_usage: bool,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Answer from a run's saved ending once the run itself is no longer kept: the same object,
    or a stream rebuilt from it (the same content, in fewer chunks)."""
    completed = terminal.status is RunStatus.COMPLETED and terminal.completion is not None
    if terminal.refused or (not stream and not completed):
        error = terminal_error(terminal)
        error.headers.update(headers or {})
        raise error
    if not stream:
        return web.Response(
            body=terminal.completion, content_type="application/json", headers=headers
        )
    payloads = completion_chunks(terminal.completion, include_usage) if terminal.completion else []
    if terminal.error is not None:
        payloads.append(orjson.dumps({"error": terminal.error}))
    events = [(seq, payload, None, 0) for seq, payload in enumerate(payloads, 1)]
    writer = await SSEWriter.open(request, 0, headers, first=events)
    await writer.close()
    return writer.response
