"""Slow clients: a follower that fell behind gets its backlog of text chunks merged.

A follower reads from the run's log whatever arrived while its last write was blocked on the
client. When that backlog is long, runs of plain text chunks of one choice become one chunk
(numbered with the last event's seq, so a resume from it is still exact); role, tool-call,
finish, usage and error events are never merged or dropped (design §3). Merging works on the
events' own text (each log entry of a plain text delta carries it), and the merged chunk is
rendered by the run's renderer: nothing here knows the chunk's shape. Memory stays bounded
because the follower never holds more than one read of the log, and the log is bounded too.
"""

from __future__ import annotations

from adapters.chat_chunks import ChunkRenderer
from adapters.events import TextDelta
from gateway.state.run_store import LogEvent, LogEvents

COALESCE_AT = 16  # a read this long means the client is behind: merge its text


def coalesce(events: LogEvents, renderer: ChunkRenderer) -> LogEvents:
    """The same events, with consecutive text chunks of one choice merged when behind."""
    if len(events) < COALESCE_AT:
        return events
    out: LogEvents = []
    run: list[LogEvent] = []  # consecutive text chunks of one choice

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            text, index = "".join(e[2] or "" for e in run), run[0][3]
            out.append((run[-1][0], renderer.render(TextDelta(text, index)), text, index))
        run.clear()

    for event in events:
        if event[2] is None:  # not a plain text delta
            flush()
            out.append(event)
            continue
        if run and run[-1][3] != event[3]:
            flush()
        run.append(event)
    flush()
    return out
