"""The one follow loop behind every stream of a run: chat chunks and Responses events alike.

A stream counts as one of the run's followers while it reads (so a dropped connection starts the
run's disconnect grace window instead of stopping it), waits for the run's first events up to
one heartbeat interval, opens the SSE writer with them, then relays the log until it ends. What
the events become on the wire is the `Frames`' business: the loop knows nothing of either
protocol. A disconnect, a slow client and a lost store are counted and ended here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import structlog
from aiohttp import web

from gateway.app_keys import METRICS, OPEN_STREAMS, RUNS, SETTINGS
from gateway.http.errors import internal_error, terminal_error
from gateway.http.sse import Framing, SlowClient, SSEWriter
from gateway.runs.endings import store_unavailable_error
from gateway.runs.manager import RunManager
from gateway.state.run_store import (
    LogEvents,
    ResumeWindowExpired,
    RunRecord,
    StoreUnavailable,
    TerminalRecord,
    UnknownRun,
)
from gateway.tracing.setup import note

log = structlog.get_logger("sluice.streaming")
FOLLOW_BATCH = 512  # most events read from the log at once


class Frames(Protocol):
    """What one kind of stream sends for a run's log: (id, payload, …) events for the writer."""

    start: int  # the log's seq to read after
    wants_ending: bool  # the stream ends with events made from the run's terminal record

    def first(self, events: LogEvents) -> LogEvents:
        """The events of the stream's first write (with the log's first read, maybe empty)."""

    def batch(self, events: LogEvents, behind: bool) -> LogEvents:
        """The events for one read of the log; `behind`: the client's last write waited."""

    def ending(self, terminal: TerminalRecord) -> LogEvents:
        """The events that end the stream of a run that ended so."""


class _Delivery:
    """The stream's `Deliver` (gateway/state/run_store.py): once its writer is open and its
    client has taken every byte so far, a batch the run's driver appends is framed and written
    in the driver's own step, so a stream that keeps up costs no wake-up of its task and no read
    of the log per batch. Otherwise (a client behind, a write that fails) the stream's task is
    woken and reads the batch itself, as it would without this.

    While the stream waits for its first events, `opening` opens it with them in the driver's
    step as well (the headers and the first token leave as they are appended, not a turn of a
    busy loop later). The stream's task is still woken, to finish what opening takes: it reads
    the events again and sends only those after `opened_through`."""

    __slots__ = ("begun", "frames", "opened_through", "opening", "request", "stream", "writer")

    def __init__(
        self,
        request: web.Request,
        frames: Frames,
        stream: dict[str, Any],
        begun: list[SSEWriter],
    ) -> None:
        self.request, self.frames, self.stream, self.begun = request, frames, stream, begun
        self.writer: SSEWriter | None = None  # set once the stream's headers are out
        self.opening = False  # the stream waits for its first events
        self.opened_through = 0  # the log's last event that opening it sent

    def __call__(self, events: LogEvents) -> bool:
        writer = self.writer
        if writer is None:
            if self.opening:
                self.opening = False
                self._open(events)
            return False
        if not writer.ready:
            return False
        writer.send_now(self.frames.batch(events, False))
        return True

    def _open(self, events: LogEvents) -> None:
        writer = SSEWriter.open_now(self.request, lambda: self.frames.first(events), **self.stream)
        if writer is not None:
            self.writer = writer
            self.begun.append(writer)
            self.opened_through = events[-1][0]


@contextlib.asynccontextmanager
async def following(runs: RunManager, run_id: str) -> AsyncIterator[None]:
    """Count this request as a follower of the run while inside, however it leaves. NOTE:
    counted at once where the store can (the run is driven here): an attach awaited in a task
    of its own, shielded, costs the stream's first events two turns of a busy loop."""
    attach = None if runs.attach_now(run_id) else asyncio.ensure_future(runs.attach(run_id))
    try:
        if attach is not None:
            await asyncio.shield(attach)
        yield
    finally:
        await asyncio.shield(_detach_after(runs, attach, run_id))


async def _detach_after(runs: RunManager, attach: asyncio.Future[None] | None, run_id: str) -> None:
    if attach is not None:
        with contextlib.suppress(Exception):
            await attach
    # NOTE: a count this replica cannot write now is corrected by its next write for the run
    # (each replica's count is absolute); the stream must end cleanly all the same.
    with contextlib.suppress(StoreUnavailable, UnknownRun):
        await runs.detach(run_id)


async def stream_log(
    request: web.Request,
    record: RunRecord,
    frames: Frames,
    headers: dict[str, str] | None = None,
    *,
    resume: bool = False,
    answer_refusal: bool = True,
    framing: Framing | None = None,
) -> web.StreamResponse:
    """The run's log as SSE, through `frames`. A `resume` raises ResumeWindowExpired (before
    anything is sent) when the log no longer holds what it asks for; with `answer_refusal`, a
    run refused before any event is answered with its HTTP error instead of a stream.
    `framing`: another protocol's SSE framing (gateway/http/sse.py), else OpenAI's."""
    metrics = request.app[METRICS]
    if resume:  # an event on the run's span, when it is traced and driven here
        note(request.app[RUNS], record.run_id, "sluice.resume")
    begun: list[SSEWriter] = []  # the stream's writer, once its headers are out
    try:
        await _follow(request, record, frames, headers, resume, answer_refusal, begun, framing)
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
    finally:
        if begun:
            begun[0].abandon()
    return begun[0].response if begun else web.Response(status=499)


async def _follow(
    request: web.Request,
    record: RunRecord,
    frames: Frames,
    headers: dict[str, str] | None,
    resume: bool,
    answer_refusal: bool,
    begun: list[SSEWriter],
    framing: Framing | None,
) -> None:
    app = request.app
    runs, metrics, settings = app[RUNS], app[METRICS], app[SETTINGS]
    run_id = record.run_id
    stream = {
        "ping_interval": settings.ping_interval,
        "headers": headers,
        "write_timeout": settings.slow_client_timeout or None,
        "framing": framing,
    }
    delivery = _Delivery(request, frames, stream, begun)

    def follow(after: int) -> AsyncIterator[LogEvents]:
        return runs.follow(run_id, after, FOLLOW_BATCH, delivery)

    async with following(runs, run_id), contextlib.AsyncExitStack() as closing:
        # NOTE: the answer waits for the run's first events (so that a run refused before any,
        # a 400 from the worker say, is still a plain HTTP error), but only up to one heartbeat
        # interval: a run stuck in a queue gets its headers and pings meanwhile. The run's
        # driver opens the stream with the events it appends (`_Delivery`); the stream's own
        # task, woken by them, then sends what came after those.
        events = await closing.enter_async_context(contextlib.aclosing(follow(frames.start)))
        delivery.opening = True
        try:
            first, outran, waited = await _first_events(events, settings.ping_interval, resume)
        finally:
            delivery.opening = False
        writer = delivery.writer
        if writer is None:
            if answer_refusal and first is None and not outran:  # the log ended with no event
                await _refuse(runs, run_id)
            first = None if outran else frames.first(first or [])
            writer = await SSEWriter.open(request, first=first, **stream)
            begun.append(writer)
        elif rest := [e for e in first or [] if e[0] > delivery.opened_through]:
            await writer.send(frames.batch(rest, False))
        app[OPEN_STREAMS].add(asyncio.current_task())
        metrics.active_streams.inc()
        try:
            if outran:
                await _fell_behind(writer)
                return
            if waited:  # the timeout ended that read: follow on from the same place
                after = max(frames.start, delivery.opened_through)
                events = await closing.enter_async_context(contextlib.aclosing(follow(after)))
            delivery.writer = writer
            await _relay(runs, run_id, events, writer, frames)
        finally:
            metrics.active_streams.dec()
            metrics.client_blocked.observe(writer.blocked)


async def _refuse(runs: RunManager, run_id: str) -> None:
    """A run whose log ended with no event: if it was refused, its HTTP error is the answer."""
    terminal = (await runs.get(run_id)).terminal
    if terminal is not None and terminal.refused:
        raise terminal_error(terminal)


async def _first_events(
    events: AsyncIterator[LogEvents], wait: float, resume: bool
) -> tuple[LogEvents | None, bool, bool]:
    """(the first events, None when the log ended without any; whether the run outran its log
    before this request read it; whether none came within `wait`, which ended `events` with
    nothing read). A resume raises ResumeWindowExpired instead of outrunning."""
    try:
        async with asyncio.timeout(wait or None):
            return await anext(events, None), False, False
    except TimeoutError:
        return [], False, True
    except ResumeWindowExpired:
        if resume:
            raise
        return None, True, False


async def _relay(
    runs: RunManager,
    run_id: str,
    events: AsyncIterator[LogEvents],
    writer: SSEWriter,
    frames: Frames,
) -> None:
    """Send everything until the run's log ends."""
    try:
        async for batch in events:
            # NOTE: only a client whose last write waited has a backlog to merge; a long read
            # for one that keeps up (an upstream burst, a replay) goes out event by event.
            await writer.send(frames.batch(batch, writer.behind))
        if frames.wants_ending and (terminal := (await runs.get(run_id)).terminal) is not None:
            await writer.send(frames.ending(terminal))
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
