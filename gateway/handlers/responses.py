"""The Responses API routes (design §4): a response is a run, answered by the second renderer.

`POST /v1/responses` opens a run through the same RunLife as a chat completion (idempotency
keys, quotas, deadlines, the safety window, the pool); the other routes read, resume, cancel
or delete it, each only for the response's tenant (another tenant's id is a 404).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
from aiohttp import web

from gateway.app_keys import DRAIN, METRICS, PRINCIPAL, RUNS
from gateway.handlers.answers import following
from gateway.handlers.chat import read_json
from gateway.handlers.runs import cancelled
from gateway.http.errors import APIError, invalid_request, resume_window_expired, terminal_error
from gateway.http.follow_access import HEADER, accepts_follow_token, follow_token
from gateway.protocol import parse_chat_request
from gateway.responses.objects import (
    META,
    conversation_of,
    current_object,
    ended_object,
    is_deleted,
    is_response,
    tombstone,
)
from gateway.responses.request import ResponseParams, chat_body, renamed, response_params
from gateway.responses.stream import last_sequence, stream_response
from gateway.runs.life import RunLife
from gateway.runs.replays import idempotent_run_gone
from gateway.state.run_store import ResumeWindowExpired, RunRecord, UnknownRun
from wire.limits import shown


def _not_found(response_id: str, param: str = "id") -> APIError:
    return APIError(
        404, f"No response found with id {shown(response_id)}.", param=param, code="not_found"
    )


def _json(body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def owned_response(request: web.Request, response_id: str, param: str = "id") -> RunRecord:
    """The stored response of this tenant with this id; a 404 for anything else."""
    runs = request.app[RUNS]
    try:
        record = await runs.get(response_id)
    except UnknownRun:
        raise _not_found(response_id, param) from None
    if (
        record.tenant != request[PRINCIPAL].tenant
        or not is_response(record)
        or not record.meta[META]["store"]
        or await is_deleted(runs, response_id)
    ):
        raise _not_found(response_id, param)
    return record


async def _history(request: web.Request, params: ResponseParams) -> list[dict[str, Any]]:
    previous = params.previous_response_id
    if previous is None:
        return []
    record = await owned_response(request, previous, "previous_response_id")
    if record.terminal is None:
        raise invalid_request(
            "previous_response_id",
            f"Response {shown(previous)} is still in progress; continue it once it has ended.",
        )
    return conversation_of(record)


async def create_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: stream, wait for the object, or (background) answer at once."""
    request.app[DRAIN].refuse_new_runs()
    body = await read_json(request)
    params = response_params(body)
    history = await _history(request, params)
    try:
        chat_json = chat_body(body, params, history)
        chat = parse_chat_request(chat_json)
        params.max_output_tokens = chat.max_tokens
        params.temperature, params.top_p = chat.temperature, chat.top_p
        params.metadata = chat.metadata or {}
        meta = {META: params.to_meta(), "background": params.background}
        life = RunLife(request, chat, chat_json, run_id=f"resp_{uuid.uuid4().hex}", meta=meta)
    except APIError as exc:
        raise renamed(exc) from None
    opened = await life.open()
    if opened.ending is not None:  # its Idempotency-Key's run is no longer kept
        raise idempotent_run_gone(opened.run_id, "response")
    token = opened.headers[HEADER] = follow_token(request, opened.run_id, life.tenant.name)
    runs = request.app[RUNS]
    record = await runs.get(opened.run_id)
    if params.stream:
        try:
            return await stream_response(request, record, -1, opened.headers, opening=True)
        except APIError as exc:  # refused by the backend before its first event
            raise renamed(exc) from None
    if params.background:
        return _json(await current_object(runs, record) | {"follow_token": token}, opened.headers)
    try:
        async with following(runs, record.run_id):
            terminal = await runs.result(record.run_id)
    except asyncio.CancelledError:
        request.app[METRICS].disconnects.inc()
        raise
    if terminal.refused:
        raise renamed(terminal_error(terminal))
    return _json(ended_object(record, terminal) | {"follow_token": token}, opened.headers)


def _starting_after(request: web.Request) -> int:
    """The last `sequence_number` the client has (`starting_after`, or `Last-Event-ID`); -1
    when it has none (the stream starts with `response.created`, number 0)."""
    raw = request.query.get("starting_after")
    param = "starting_after"
    if raw is None:
        raw, param = request.headers.get("Last-Event-ID"), "Last-Event-ID"
    if raw is None or raw == "":
        return -1
    if not raw.isdigit():
        raise invalid_request(param, f"'{param}' must be a non-negative integer.")
    return int(raw)


@accepts_follow_token
async def retrieve_response(request: web.Request) -> web.StreamResponse:
    """`GET /v1/responses/{id}`, or with `?stream=true` its events after `starting_after`
    (204 when the response has ended and the client has its last event: `EventSource` stops).
    A follow token (`?token=`) reads it too."""
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise invalid_request("stream", "'stream' must be true or false.")
    after = _starting_after(request)
    record = await owned_response(request, request.match_info["id"])
    runs = request.app[RUNS]
    if stream == "false":
        token = follow_token(request, record.run_id, record.tenant)
        return _json(await current_object(runs, record) | {"follow_token": token}, {HEADER: token})
    resumes = request.app[METRICS].resumes
    outcome = "replayed" if record.status.is_terminal else "live"
    try:
        if record.status.is_terminal and after >= await last_sequence(runs, record):
            resumes.labels(outcome).inc()
            return web.Response(status=204)
        response = await stream_response(request, record, after)
    except ResumeWindowExpired:
        resumes.labels("expired").inc()
        raise resume_window_expired(
            f"The events of '{record.run_id}' are no longer retained; retrieve the response "
            "without stream=true for its final object."
        ) from None
    resumes.labels(outcome).inc()
    return response


async def cancel_response(request: web.Request) -> web.Response:
    """`POST /v1/responses/{id}/cancel`: idempotent; answers the response once it has ended."""
    record = await cancelled(request, await owned_response(request, request.match_info["id"]))
    return _json(await current_object(request.app[RUNS], record))


async def delete_response(request: web.Request) -> web.Response:
    """`DELETE /v1/responses/{id}`: a live run is cancelled; the id answers 404 from now on."""
    record = await owned_response(request, request.match_info["id"])
    runs = request.app[RUNS]
    if not record.status.is_terminal:
        await runs.cancel(record.run_id, "client")
    await tombstone(runs, record)
    return _json({"id": record.run_id, "object": "response", "deleted": True})


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise invalid_request("limit", "'limit' must be an integer from 1 to 100.")
    return int(raw)


@accepts_follow_token
async def list_input_items(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}/input_items`: the items of its `input`, paged by `after`."""
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("order", "'order' must be 'asc' or 'desc'.")
    limit = _limit(request)
    record = await owned_response(request, request.match_info["id"])
    items = list(record.meta[META]["input_items"])
    if order == "desc":
        items.reverse()
    after = request.query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid_request("after", "'after' is not an item of this response.")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return _json(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
