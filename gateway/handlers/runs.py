"""The run endpoints (design §4): retrieve, resume, cancel — each only for the run's tenant.

Another tenant's run id gets the same 404 as an unknown one, so ids cannot be probed. Retrieve
and resume also take the run's follow token (`?token=`, gateway/http/follow_access.py) in place of
a credential; cancel does not.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

from gateway.app_keys import METRICS, PRINCIPAL, RUNS
from gateway.handlers.answers import stream_run
from gateway.http.errors import APIError, invalid_request, resume_window_expired
from gateway.http.follow_access import HEADER, accepts_follow_token, follow_token
from gateway.runs.status import PUBLIC_STATUS
from gateway.state.run_store import ResumeWindowExpired, RunRecord, UnknownRun

CANCEL_WAIT = 10.0  # seconds the cancel call waits for the run's terminal state


def run_not_found(run_id: str) -> APIError:
    return APIError(
        404, f"No chat completion found with id '{run_id}'.", param="id", code="not_found"
    )


async def _owned_run(request: web.Request) -> RunRecord:
    run_id = request.match_info["id"]
    try:
        record = await request.app[RUNS].get(run_id)
    except UnknownRun:
        raise run_not_found(run_id) from None
    if record.tenant != request[PRINCIPAL].tenant:
        raise run_not_found(run_id)
    return record


def run_object(record: RunRecord) -> dict[str, Any]:
    """The `chat.completion` object of a run with its `status`; the final one once it ended."""
    terminal = record.terminal
    body = None if terminal is None else terminal.completion_object()
    if body is None:
        body = {
            "id": record.run_id,
            "object": "chat.completion",
            "created": int(record.created),
            "model": record.model,
            "choices": [],
        }
        if (tier := record.meta.get("service_tier")) is not None:
            body["service_tier"] = tier
    body["status"] = PUBLIC_STATUS[record.status]
    if terminal is not None and terminal.error is not None:
        body["error"] = terminal.error
    return body


def _json(body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


def resume_point(request: web.Request) -> int:
    """`Last-Event-ID` (header) or `starting_after` (query): the last event the client has.
    NOTE: the header wins: an `EventSource` opened on a URL with `starting_after` sends the
    header when it reconnects, naming what it got since, while the URL still says the first."""
    raw = request.headers.get("Last-Event-ID")
    param = "Last-Event-ID"
    if raw is None:
        raw, param = request.query.get("starting_after"), "starting_after"
    if raw is None or raw == "":
        return 0
    if not raw.isdigit():
        raise invalid_request(param, f"'{param}' must be a non-negative integer event id.")
    return int(raw)


def nothing_after(record: RunRecord, after: int) -> bool:
    """Whether a resume after event `after` has nothing left to send: the run has ended and
    the client has its last event. Such a resume answers 204, which (unlike a stream of just
    `[DONE]`) makes a browser's `EventSource` stop reconnecting."""
    return record.status.is_terminal and after >= record.last_seq


@accepts_follow_token
async def retrieve_chat_completion(request: web.Request) -> web.StreamResponse:
    """`GET /v1/chat/completions/{id}`, or with `?stream=true` a resume of its stream."""
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise invalid_request("stream", "'stream' must be true or false.")
    if stream == "false":
        record = await _owned_run(request)
        token = follow_token(request, record.run_id, record.tenant)
        body = run_object(record) | {"follow_token": token}
        return _json(body, {HEADER: token})
    resumes = request.app[METRICS].resumes
    after = resume_point(request)
    try:
        record = await _owned_run(request)
    except APIError:
        resumes.labels("not_found").inc()
        raise
    outcome = "replayed" if record.status.is_terminal else "live"
    if nothing_after(record, after):
        resumes.labels(outcome).inc()
        return web.Response(status=204)
    try:
        response = await stream_run(request, record, after, resume=True)
    except asyncio.CancelledError:  # a resume all the same, whose client went away again
        resumes.labels(outcome).inc()
        raise
    except ResumeWindowExpired:
        resumes.labels("expired").inc()
        raise resume_window_expired(
            f"Events after {after} of '{record.run_id}' are no longer retained; "
            "retrieve the run without stream=true for its final object."
        ) from None
    resumes.labels(outcome).inc()
    return response


async def cancelled(request: web.Request, record: RunRecord) -> RunRecord:
    """The run cancelled by its client (idempotent), as it stands once it ended, or after
    CANCEL_WAIT if its upstream is slow to confirm."""
    runs = request.app[RUNS]
    if record.status.is_terminal:
        return record
    await runs.cancel(record.run_id, "client")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CANCEL_WAIT):
            await runs.result(record.run_id)
    return await runs.get(record.run_id)


async def cancel_chat_completion(request: web.Request) -> web.Response:
    """`POST /v1/chat/completions/{id}/cancel`: idempotent; answers the run's terminal status."""
    return _json(run_object(await cancelled(request, await _owned_run(request))))
