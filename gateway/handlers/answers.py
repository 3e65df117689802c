"""Answering from a run: follow its event log as an SSE stream, or wait for its final object.

Both the request that started a run and a later resume go through `stream_run`, the one follow
loop of gateway/runs/follow.py with the chat's frames: the log's chunks as they are.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from adapters.chat_chunks import ChunkRenderer, completion_chunks
from adapters.requests import ChatRequest
from gateway.app_keys import METRICS, RUNS
from gateway.http.backpressure import COALESCE_AT, coalesce
from gateway.http.errors import terminal_error
from gateway.http.sse import SSEWriter
from gateway.runs.follow import following, stream_log
from gateway.runs.life import Opened
from gateway.runs.status import RunStatus
from gateway.state.run_store import LogEvents, RunRecord, TerminalRecord

__all__ = ["answer", "following", "respond_with_ending", "respond_with_result", "stream_run"]


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


class ChatFrames:
    """A chat stream's events are the log's own chunks; a client that fell behind gets the
    text of its backlog merged (gateway/http/backpressure.py)."""

    __slots__ = ("_record", "_renderer", "start")
    wants_ending = False

    def __init__(self, record: RunRecord, after: int) -> None:
        self._record = record
        self._renderer: ChunkRenderer | None = None  # made when a backlog is first merged
        self.start = after

    def first(self, events: LogEvents) -> LogEvents:
        return events

    def batch(self, events: LogEvents, behind: bool) -> LogEvents:
        if not behind or len(events) < COALESCE_AT:
            return events
        if self._renderer is None:
            record = self._record
            self._renderer = ChunkRenderer(
                record.run_id,
                served_model(events, record.model),
                int(record.created),
                record.meta.get("service_tier"),
            )
        return coalesce(events, self._renderer)

    def ending(self, terminal: TerminalRecord) -> LogEvents:
        return []


def served_model(events: LogEvents, asked: str) -> str:
    """The model the log's chunks name: the one asked for, or the target of a model alias
    that served it (adapters/fallback.py), which the run record does not know."""
    for _, payload, _, _ in events:
        chunk = orjson.loads(payload)
        if isinstance(chunk, dict) and isinstance(chunk.get("model"), str):
            return chunk["model"]
    return asked


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
    return await stream_log(request, record, ChatFrames(record, after), headers, resume=resume)


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
