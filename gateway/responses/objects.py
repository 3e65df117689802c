"""A response's object and its stored parts, read back from its run.

A response's run record carries its Responses fields (`meta["response"]`); its output is what
its log (while it runs) or its final chat completion (once it ended) holds, told by the same
renderer the stream uses, so the object a retrieve returns and the one the stream ends with
agree item for item.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from adapters.chat_chunks import completion_chunks, logged_events
from gateway.responses.items import output_messages
from gateway.responses.render import ResponseRenderer, response_status
from gateway.responses.request import ResponseParams
from gateway.runs.manager import RunManager
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from gateway.state.run_store import ResumeWindowExpired, RunRecord, TerminalRecord, UnknownRun

META = "response"  # the run record's meta key for a response's fields
DELETED = ".deleted"  # the id suffix of a deleted response's tombstone record


def is_response(record: RunRecord) -> bool:
    return META in record.meta


def params_of(record: RunRecord) -> ResponseParams:
    return ResponseParams.from_meta(record.meta[META])


def renderer_for(record: RunRecord) -> ResponseRenderer:
    return ResponseRenderer(
        record.run_id,
        record.model,
        record.created,
        params_of(record),
        service_tier=record.meta.get("service_tier"),
    )


def ended_object(record: RunRecord, terminal: TerminalRecord) -> dict[str, Any]:
    """The final object of a response whose run ended so."""
    renderer = renderer_for(record)
    if terminal.completion is not None:
        for payload in completion_chunks(terminal.completion):
            renderer.feed(logged_events(payload))
    status = response_status(terminal.status, terminal.finish_reason)
    renderer.ending(terminal)
    return renderer.response(status, terminal)


async def current_object(runs: RunManager, record: RunRecord) -> dict[str, Any]:
    """The object now: the final one once the run ended, else its output so far."""
    if record.terminal is not None:
        return ended_object(record, record.terminal)
    renderer = renderer_for(record)
    with contextlib.suppress(ResumeWindowExpired):
        for _, payload, _, _ in await runs.store.read(record.run_id, 0):
            renderer.feed(logged_events(payload))
    return renderer.response(PUBLIC_STATUS[record.status])


def conversation_of(record: RunRecord) -> list[dict[str, Any]]:
    """The chat messages a response continuing this one starts from: its conversation, its
    output."""
    params = params_of(record)
    output = ended_object(record, record.terminal)["output"] if record.terminal else []
    return params.conversation + output_messages(output)


# NOTE: a run's record and log cannot be taken out of the store before their retention ends (a
# follower may be reading them, replicas mirror them); a delete leaves an ended tombstone
# record beside the run instead, which expires with the same retention. The response's routes
# answer 404 once it is there.
async def tombstone(runs: RunManager, record: RunRecord) -> None:
    """Mark a response deleted (idempotent)."""
    mark = RunRecord(record.run_id + DELETED, record.tenant, record.model, time.time())
    with contextlib.suppress(ValueError):  # deleted twice at once: one mark is enough
        await runs.store.create(mark)
    await runs.store.finish(
        mark.run_id, TerminalRecord(RunStatus.CANCELLED, "deleted", at=time.time())
    )


async def is_deleted(runs: RunManager, response_id: str) -> bool:
    try:
        await runs.store.get(response_id + DELETED)
    except UnknownRun:
        return False
    return True
