"""A response's run as a stream of typed events, from its start or after a `sequence_number`.

The run's log is followed by the same loop as a chat stream (gateway/runs/follow.py: the request
counts as a follower, so the disconnect grace applies, and a background run ignores it); the log
is read from its start, each batch goes through the response renderer, and what comes after the
client's `starting_after` is sent. The stream ends with the terminal event, then `data: [DONE]`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from adapters.chat_chunks import logged_events
from gateway.responses.objects import renderer_for
from gateway.responses.render import ResponseRenderer
from gateway.runs.follow import stream_log
from gateway.runs.manager import RunManager
from gateway.state.run_store import LogEvents, RunRecord, TerminalRecord


def numbered(events: list[dict[str, Any]], after: int) -> LogEvents:
    """Events past `after` as the writer's (seq, payload) tuples: the id is the sequence number."""
    return [
        (e["sequence_number"], orjson.dumps(e), None, 0)
        for e in events
        if e["sequence_number"] > after
    ]


class ResponseFrames:
    """The log's chunks as Responses events, numbered, those after `after` only."""

    __slots__ = ("_after", "_renderer")
    start = 0  # the events are numbered from the log's start: it is always read from there
    wants_ending = True

    def __init__(self, record: RunRecord, after: int) -> None:
        self._renderer = renderer_for(record)
        self._after = after

    def first(self, events: LogEvents) -> LogEvents:
        return numbered(self._renderer.opening() + _render(self._renderer, events), self._after)

    def batch(self, events: LogEvents, behind: bool) -> LogEvents:
        return numbered(_render(self._renderer, events), self._after)

    def ending(self, terminal: TerminalRecord) -> LogEvents:
        return numbered(self._renderer.ending(terminal), self._after)


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
    frames = ResponseFrames(record, after)
    return await stream_log(
        request, record, frames, headers, resume=not opening, answer_refusal=opening
    )


def _render(renderer: ResponseRenderer, batch: LogEvents) -> list[dict[str, Any]]:
    return [event for _, payload, _, _ in batch for event in renderer.feed(logged_events(payload))]


async def last_sequence(runs: RunManager, record: RunRecord) -> int:
    """The `sequence_number` an ended response's stream ends with (its terminal event).
    Raises ResumeWindowExpired when its log's start is no longer kept."""
    renderer = renderer_for(record)
    renderer.opening()
    _render(renderer, await runs.store.read(record.run_id, 0))
    renderer.ending(record.terminal)
    return renderer.sequence - 1
