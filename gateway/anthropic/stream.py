"""A Messages run as Anthropic's stream: named SSE events (`event: <type>`), no `[DONE]`.

The run's log is followed by the same loop as a chat stream (gateway/runs/follow.py: the request
counts as a follower, so the disconnect grace applies and a dropped stream cancels the run); the
log is read from its start and each batch goes through the message renderer. Each event is
framed whole here (its `event:` line names its type), so the writer only joins the frames.

NOTE: `message_start` waits for the run's first chunk, which the run writes once its backend
accepted it and which carries the prompt's tokens; a run still waiting for capacity gets the
stream's headers and `: ping` comments meanwhile, as any stream does.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from adapters.chat_chunks import logged_events
from gateway.anthropic.errors import stream_error
from gateway.anthropic.render import MessageRenderer
from gateway.runs.follow import stream_log
from gateway.state.run_store import LogEvents, RunRecord, TerminalRecord


def framed(events: list[dict[str, Any]]) -> LogEvents:
    """Events as the writer's (seq, frame, …) tuples, each frame whole."""
    return [
        (0, b"event: %s\ndata: %b\n\n" % (e["type"].encode(), orjson.dumps(e)), None, 0)
        for e in events
    ]


class AnthropicFraming:
    """The writer's framing for these streams: frames pass as made; an error is an `error`
    event; the stream ends with nothing more (Anthropic's has no `[DONE]`)."""

    done = b""

    def frame(self, seq: int, payload: bytes) -> bytes:
        return payload

    def error(self, error: dict) -> bytes:
        return framed([stream_error(error)])[0][1]


class MessageFrames:
    """The log's chunks as Messages events."""

    __slots__ = ("_renderer",)
    start = 0  # the log is read from its start
    wants_ending = True

    def __init__(self, record: RunRecord) -> None:
        self._renderer = MessageRenderer(record.run_id, record.model)

    def first(self, events: LogEvents) -> LogEvents:
        return framed(self._render(events))

    def batch(self, events: LogEvents, behind: bool) -> LogEvents:
        return framed(self._render(events))

    def ending(self, terminal: TerminalRecord) -> LogEvents:
        return framed(self._renderer.ending(terminal))

    def _render(self, batch: LogEvents) -> list[dict[str, Any]]:
        renderer = self._renderer
        return [e for _, payload, _, _ in batch for e in renderer.feed(logged_events(payload))]


async def stream_message(
    request: web.Request, record: RunRecord, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    """The run's events as Anthropic's stream; a run refused before its first event is
    answered with its HTTP error instead."""
    return await stream_log(
        request, record, MessageFrames(record), headers, framing=AnthropicFraming()
    )
