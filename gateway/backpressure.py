"""Slow clients: a follower that fell behind gets its backlog of text chunks merged.

A follower reads from the run's log whatever arrived while its last write was blocked on the
client. When that backlog is long, runs of plain text chunks of one choice become one chunk
(numbered with the last event's seq, so a resume from it is still exact); role, tool-call,
finish, usage and error events are never merged or dropped (DESIGN §3). Memory stays bounded
because the follower never holds more than one read of the log, and the log is a bounded ring.
"""

from __future__ import annotations

from typing import Any

import orjson

COALESCE_AT = 16  # a read this long means the client is behind: merge its text

# what every plain text chunk of `adapters.to_openai` ends with
_PLAIN_TEXT_TAIL = b'"logprobs":null,"finish_reason":null}]}'


def _plain_text(payload: bytes) -> tuple[dict[str, Any], int, str] | None:
    """(chunk, choice index, text) when the payload is a chunk carrying only text."""
    if not payload.endswith(_PLAIN_TEXT_TAIL) or b'"content":' not in payload:
        return None
    chunk = orjson.loads(payload)
    choices = chunk.get("choices")
    if not choices or len(choices) != 1 or "usage" in chunk:
        return None
    delta = choices[0]["delta"]
    if delta.keys() != {"content"} or not isinstance(delta["content"], str):
        return None
    return chunk, choices[0]["index"], delta["content"]


def coalesce(events: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The same events, with consecutive text chunks of one choice merged when behind."""
    if len(events) < COALESCE_AT:
        return events
    out: list[tuple[int, bytes]] = []
    run: list[tuple[int, dict[str, Any], int, str]] = []  # seq, chunk, index, text

    def flush() -> None:
        if not run:
            return
        seq, chunk = run[-1][0], run[0][1]
        if len(run) > 1:
            chunk["choices"][0]["delta"]["content"] = "".join(r[3] for r in run)
        out.append((seq, orjson.dumps(chunk)))
        run.clear()

    for seq, payload in events:
        text = _plain_text(payload)
        if text is None:
            flush()
            out.append((seq, payload))
            continue
        chunk, index, content = text
        if run and run[-1][2] != index:
            flush()
        run.append((seq, chunk, index, content))
    flush()
    return out
