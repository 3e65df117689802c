"""The one SSE writer every stream goes through.

Framing (design §3): a `retry:` hint first, then `id: <seq>` and `data: <json>` and a blank line
per event, where `seq` is the event's number in the run's log (so `Last-Event-ID` resumes
exactly); `: ping` comment lines while idle; the stream always ends with `data: [DONE]`. Frames
produced together are written in one call. The writer also times how long writes wait on the
client (a slow reader fills the socket buffer and `write` blocks): that time is the client's, not
generation's, and past `write_timeout` the client counts as gone. Another protocol's stream
(Anthropic's named events) hands the writer its `Framing`: the same writes, heartbeats and
timeouts, its own frames, error frame and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import orjson
from aiohttp import web

from common.aiohttp_internals import HeadersWithFirstWrite
from gateway.state.run_store import LogEvents

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}
# NOTE: a heartbeat is one comment line with no blank line after it. A blank line ends an event,
# and the openai SDK's decoder (keeping the last `id:` as the spec says) would then hand the
# caller an event with empty data, which it fails to parse as JSON. The comment line still keeps
# proxies from timing the stream out, and is ignored inside the next event.
PING = b": ping\n"
# The reconnection delay a browser's EventSource waits after a dropped stream. Like a ping, one
# line with no blank line after it, at the start of every stream: decoders apply it at once
# (WHATWG) or keep it for the first event (the openai SDK), and neither sees an event of its own.
RETRY_MS = 1000
RETRY = b"retry: %d\n" % RETRY_MS
DONE = b"data: [DONE]\n\n"
_BLOCKED = 0.001  # a write that took longer than this waited on the client
# a stream's write buffer: past the high mark its writes wait, until it is down to the low mark
WRITE_HIGH_WATER = 64 * 1024
WRITE_LOW_WATER = 16 * 1024


class Framing(Protocol):
    """Another protocol's SSE framing (Anthropic's named events, gateway/anthropic/stream.py):
    how its events, an error that is not one of them, and the stream's end are written."""

    done: bytes  # the stream's last bytes

    def frame(self, seq: int, payload: bytes) -> bytes: ...

    def error(self, error: dict) -> bytes:
        """An OpenAI error object as this protocol's error frame."""


def write_now(response: web.StreamResponse, body: bytes) -> None:
    """`await response.write(body)` run to its first suspension and no further: the bytes are
    in the transport at once. aiohttp's write suspends only after writing, to wait for a full
    socket buffer to drain (the responses here are never compressed, the one case that would
    suspend first); that wait is skipped, so the caller looks at the buffer before its next
    write. Cheaper than awaiting it: no coroutine step through the event loop."""
    if response.compression:  # its write would suspend before writing: never skip it
        raise RuntimeError("a compressed stream cannot be written without waiting")
    step = response.write(body)
    try:
        step.send(None)
    except StopIteration:
        return
    step.close()


def completes_now(step: Coroutine[Any, Any, Any]) -> bool:
    """Run `step` to its end if it gets there without suspending (True). One that suspends is
    cancelled where it waits, as a task's cancel would, and closed (False)."""
    try:
        step.send(None)
    except StopIteration:
        return True
    with contextlib.suppress(asyncio.CancelledError, Exception):  # its cancel, or its error
        step.throw(asyncio.CancelledError())
    step.close()
    return False


def _sse_response(headers: dict[str, str] | None, with_first: bool) -> web.StreamResponse:
    """A stream's response; `with_first` events, its headers go out with them in one write."""
    response_class = HeadersWithFirstWrite if with_first else web.StreamResponse
    return response_class(status=200, headers={**SSE_HEADERS, **(headers or {})})


class SlowClient(ConnectionError):
    """The client took no bytes for longer than the write timeout."""


class SSEWriter:
    """Writes framed events to one prepared `StreamResponse`, with heartbeats while idle."""

    __slots__ = (
        "_framing",
        "_heartbeat",
        "_last_write",
        "_ping_interval",
        "_response",
        "_transport",
        "_write_timeout",
        "behind",
        "blocked",
        "last_seq",
    )

    def __init__(
        self,
        response: web.StreamResponse,
        ping_interval: float = 15.0,
        write_timeout: float | None = None,
        transport: asyncio.Transport | None = None,
        framing: Framing | None = None,
    ) -> None:
        self._response = response
        self._framing = framing  # None: OpenAI's `id:`/`data:` frames, written directly
        self._transport = transport
        if transport is not None and not transport.is_closing():  # (uvloop's refuses it then)
            # NOTE: asyncio's own marks, set so that a slow client is told apart the same on
            # either loop (gateway/event_loop.py): uvloop's writer resumes at 16 bytes, not 16
            # KiB, so one that waited would have nothing queued after and never be `behind`
            transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        self._ping_interval = ping_interval
        self._write_timeout = write_timeout
        self._last_write = time.monotonic()
        # a timer while waiting, a task only while a ping is being written
        self._heartbeat: asyncio.TimerHandle | asyncio.Task[None] | None = None
        self.blocked = 0.0  # seconds writes spent waiting for the client
        self.behind = False  # the last write waited for the client: it is not keeping up
        self.last_seq = 0

    @classmethod
    async def open(
        cls,
        request: web.Request,
        ping_interval: float = 15.0,
        headers: dict[str, str] | None = None,
        first: LogEvents | None = None,
        write_timeout: float | None = None,
        framing: Framing | None = None,
    ) -> SSEWriter:
        """Start the stream; `first` events are framed into the same write as the headers."""
        response = _sse_response(headers, bool(first))
        await response.prepare(request)
        writer = cls(response, ping_interval, write_timeout, request.transport, framing)
        await writer.send(first or [], preamble=RETRY)
        writer._start_heartbeat()
        return writer

    @classmethod
    def open_now(
        cls,
        request: web.Request,
        first: Callable[[], LogEvents],
        ping_interval: float = 15.0,
        headers: dict[str, str] | None = None,
        write_timeout: float | None = None,
        framing: Framing | None = None,
    ) -> SSEWriter | None:
        """`open` run in the caller's step, with no suspension: the run's driver opens a stream
        that waits for its first events this way as it appends them (gateway/runs/follow.py).
        `first` frames them, once the response is prepared. None where preparing it would wait
        (a prepare hook reading a store): nothing was sent or framed, and the stream's own task
        opens it as usual."""
        response = _sse_response(headers, with_first=True)
        if not completes_now(response.prepare(request)):
            return None
        writer = cls(response, ping_interval, write_timeout, request.transport, framing)
        writer.send_now(first(), preamble=RETRY)
        writer._start_heartbeat()
        return writer

    @property
    def response(self) -> web.StreamResponse:
        return self._response

    async def send(self, events: LogEvents, preamble: bytes = b"") -> None:
        """Frame each (seq, chunk) event and write them all at once, after `preamble`."""
        if body := self._body(events, preamble):
            await self._write(body)

    @property
    def ready(self) -> bool:
        """The client has taken every byte written so far: a write now cannot wait."""
        transport = self._transport
        return (
            not self.behind
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        )

    def send_now(self, events: LogEvents, preamble: bytes = b"") -> None:
        """`send` for a client that is `ready`, without a suspension: the run's driver writes a
        caught-up stream's events this way as it appends them (gateway/runs/follow.py)."""
        if body := self._body(events, preamble):
            self._last_write = time.monotonic()
            write_now(self._response, body)
            self.behind = self._transport.get_write_buffer_size() > 0

    def _body(self, events: LogEvents, preamble: bytes) -> bytes:
        if events:
            self.last_seq = events[-1][0]
        if self._framing is not None:
            frame = self._framing.frame
            return preamble + b"".join([frame(e[0], e[1]) for e in events])
        if len(events) == 1:  # a live stream's usual write: one event, framed directly
            return preamble + b"id: %d\ndata: %b\n\n" % (events[0][0], events[0][1])
        return preamble + b"".join([b"id: %d\ndata: %b\n\n" % (e[0], e[1]) for e in events])

    async def send_error(self, error: dict) -> None:
        """An error that is not an event of the run (it gets no id)."""
        if self._framing is not None:
            await self._write(self._framing.error(error))
            return
        await self._write(b"data: %b\n\n" % orjson.dumps({"error": error}))

    async def close(self) -> None:
        """Write `[DONE]` (or the framing's end) and end the response; safe to call on a
        broken connection."""
        self._stop_heartbeat()
        done = DONE if self._framing is None else self._framing.done
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._response.write_eof(done)  # one write: last frame and end of body

    def abandon(self) -> None:
        """Stop heartbeats without writing: the client is gone."""
        self._stop_heartbeat()

    async def _write(self, body: bytes) -> None:
        began = self._last_write = time.monotonic()
        transport = self._transport
        # NOTE: a write can only block while asyncio has paused the writer. It pauses past the
        # high-water mark but resumes only at the low-water mark, so a buffer between the two
        # may still be paused: only at or under the low mark can the timeout's timer (pure cost
        # on every frame of a healthy stream) be skipped.
        if transport is None:
            await self._response.write(body)
        elif (
            transport.get_write_buffer_size() + len(body) <= transport.get_write_buffer_limits()[0]
        ):
            write_now(self._response, body)  # NOTE: it cannot wait; no coroutine, no timer
        elif self._write_timeout is None:
            await self._response.write(body)
        else:
            try:
                async with asyncio.timeout(self._write_timeout):
                    await self._response.write(body)
            except TimeoutError:
                self.blocked += time.monotonic() - began  # the wait that gave up counts too
                raise SlowClient from None
        took = time.monotonic() - began
        if took > _BLOCKED:
            self.blocked += took
        # NOTE: behind means bytes are still queued for this client after the write: its socket
        # took less than we sent. A write that merely took long (the loop was busy, the process
        # descheduled on a loaded machine) says nothing about the client, and must not make its
        # chunks merge.
        if transport is None:
            self.behind = took > _BLOCKED
        else:
            self.behind = transport.get_write_buffer_size() > 0

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None

    # NOTE: the heartbeat is a timer, not a task per stream: streams are many and pings rare. The
    # timer re-arms itself for the rest of the interval after any write, and only when a stream
    # has really been idle does it start a task to write the ping. A ping is one whole write, so
    # it can never split an event frame.
    def _start_heartbeat(self) -> None:
        if self._ping_interval > 0:
            self._wait_for_idle(self._ping_interval)

    def _wait_for_idle(self, delay: float) -> None:
        self._heartbeat = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        idle = time.monotonic() - self._last_write
        if idle < self._ping_interval:
            self._wait_for_idle(self._ping_interval - idle)
        else:
            self._heartbeat = asyncio.ensure_future(self._ping())

    async def _ping(self) -> None:
        try:
            await self._write(PING)
        except (ConnectionError, RuntimeError):
            self._heartbeat = None
            return
        self._wait_for_idle(self._ping_interval)
