"""A response's run as a stream of typed events, from its start or after a `sequence_number`.

The run's log is followed as for a chat stream (the request counts as a follower, so the
disconnect grace applies, and a background run ignores it); each batch goes through the
response renderer, and what comes after the client's `starting_after` is sent. The stream ends
with the terminal event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

from gateway.answers import FOLLOW_BATCH, following
from gateway.app_keys import METRICS, OPEN_STREAMS, RUNS, SETTINGS
from gateway.errors import terminal_error
from gateway.responses.objects import renderer_for
from gateway.runs.manager import RunManager
from gateway.runs.store import LogEvents, RunRecord
from gateway.sse import SlowClient, SSEWriter


def numbered(events: list[dict[str, Any]], after: int) -> LogEvents:
    """Events past `after` as the writer's (seq, payload) tuples: the id is the sequence number."""
    return [
        (e["sequence_number"], orjson.dumps(e), None, 0)
        for e in events
        if e["sequence_number"] > after
    ]


async def stream_response(
    request: web.Request,
    record: RunRecord,
    after: int = -1,
    headers: dict[str, str] | None = None,
    *,
    opening: bool = False,
) -> web.StreamResponse:
    """The run's events with `sequence_number` > `after` as SSE. The request that created the
    run (`opening`) answers a run refused before its first event with its HTTP error. Raises
    ResumeWindowExpired (before anything is sent) when the log's start is no longer kept."""
    metrics = request.app[METRICS]
    begun: list[SSEWriter] = []
    try:
        await _follow(request, record, after, headers, opening, begun)
    except SlowClient:
        metrics.slow_clients.inc()
        metrics.disconnects.inc()
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:
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
    after: int,
    headers: dict[str, str] | None,
    opening: bool,
    begun: list[SSEWriter],
) -> None:
    app = request.app
    runs, settings = app[RUNS], app[SETTINGS]
    renderer = renderer_for(record)
    async with (
        following(runs, record.run_id),
        contextlib.aclosing(runs.follow(record.run_id, 0, FOLLOW_BATCH)) as log,
    ):
        # NOTE: as for a chat stream, the answer waits for the run's first events (a run
        # refused before any is a plain HTTP error), but only up to one heartbeat interval.
        # A resume whose log no longer starts at the beginning raises here, before any byte.
        first_read = asyncio.ensure_future(anext(log, None))
        try:
            async with asyncio.timeout(settings.ping_interval or None):
                first = await asyncio.shield(first_read)
        except TimeoutError:
            first = None
        except BaseException:
            first_read.cancel()
            raise
        if first is None and first_read.done() and opening:
            terminal = (await runs.get(record.run_id)).terminal
            if terminal is not None and terminal.refused:
                raise terminal_error(terminal)
        events = renderer.opening() + _render(renderer, first or [])
        writer = await SSEWriter.open(
            request,
            settings.ping_interval,
            headers,
            first=numbered(events, after),
            write_timeout=settings.slow_client_timeout or None,
        )
        begun.append(writer)
        app[OPEN_STREAMS].add(asyncio.current_task())
        app[METRICS].active_streams.inc()
        try:
            if not first_read.done():
                batch = await first_read
                await writer.send(numbered(_render(renderer, batch or []), after))
            async for batch in log:
                await writer.send(numbered(_render(renderer, batch), after))
            terminal = (await runs.get(record.run_id)).terminal
            if terminal is not None:
                await writer.send(numbered(renderer.ending(terminal), after))
            await writer.close()
        finally:
            app[METRICS].active_streams.dec()
            app[METRICS].client_blocked.observe(writer.blocked)


def _render(renderer: Any, batch: LogEvents) -> list[dict[str, Any]]:
    return [event for _, payload, _, _ in batch for event in renderer.feed(payload)]


async def last_sequence(runs: RunManager, record: RunRecord) -> int:
    """The `sequence_number` an ended response's stream ends with (its terminal event).
    Raises ResumeWindowExpired when its log's start is no longer kept."""
    renderer = renderer_for(record)
    renderer.opening()
    _render(renderer, await runs.store.read(record.run_id, 0))
    renderer.ending(record.terminal)
    return renderer.sequence - 1
