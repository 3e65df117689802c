"""The legacy Completions routes: `POST /v1/completions` and its runs' retrieve, resume, cancel.

Each prompt of a legacy completion is a run opened through the same RunLife as a chat
completion (idempotency keys, quotas, deadlines, the safety window, the pool, cancel on
disconnect, the ledger; gateway/completions/opening.py); only its prompt is raw text or token
ids (`ChatRequest.prompt`) and its answer is told in the `text_completion` shape by
gateway/completions/render.py. The run record's meta says so, so that a resume or a retrieve by
its id answers in the same shape. One prompt answers from its run, as a chat completion does;
several are merged (gateway/completions/merged.py, merged_stream.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from gateway.app_keys import DRAIN, METRICS, PRINCIPAL, RUNS, TENANT
from gateway.completions.merged import merged_result
from gateway.completions.merged_stream import stream_merged
from gateway.completions.opening import PromptRun, call_headers, open_runs
from gateway.completions.render import CompletionRenderer, completion_object, replayed_chunks
from gateway.completions.request import META, CompletionParams, parse_completion_request
from gateway.handlers.answers import following
from gateway.handlers.chat import read_json
from gateway.handlers.runs import cancelled, nothing_after, resume_point
from gateway.http.errors import APIError, invalid_request, resume_window_expired, terminal_error
from gateway.http.follow_access import HEADER, accepts_follow_token, follow_token
from gateway.http.sse import SSEWriter
from gateway.runs.follow import stream_log
from gateway.runs.life import RUN_ID_HEADER
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from gateway.state.run_store import (
    LogEvents,
    ResumeWindowExpired,
    RunRecord,
    TerminalRecord,
    UnknownRun,
)


def _json(body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


class CompletionFrames:
    """A legacy completion's stream: each log chunk in the `text_completion` shape, under its
    own event id (so `Last-Event-ID` resumes as for a chat stream)."""

    __slots__ = ("_renderer", "start")
    wants_ending = False

    def __init__(self, params: CompletionParams, after: int) -> None:
        self._renderer = CompletionRenderer(params, echo=after == 0)
        self.start = after

    def first(self, events: LogEvents) -> LogEvents:
        return self.batch(events, False)

    def batch(self, events: LogEvents, behind: bool) -> LogEvents:
        out = []
        for seq, payload, _, _ in events:
            chunk = self._renderer.chunk(payload)
            if chunk is not None:
                out.append((seq, chunk, None, 0))
        return out

    def ending(self, terminal: TerminalRecord) -> LogEvents:
        return []


def _params(record: RunRecord) -> CompletionParams:
    return CompletionParams.from_meta(record.meta[META])


async def create_completion(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: stream the runs, or wait for their `text_completion` object."""
    request.app[DRAIN].refuse_new_runs()  # shutting down: retry on another replica
    body = await read_json(request)
    call = parse_completion_request(body)
    runs = await open_runs(request, call, body)
    headers = call_headers(runs)
    headers[RUN_ID_HEADER] = runs[0].run_id
    if len(runs) == 1:
        return await _single(request, runs[0], call.chat.stream, headers)
    try:
        if call.chat.stream:
            return await stream_merged(request, runs, call.include_usage, headers)
        return _json(await merged_result(request, runs), headers)
    except APIError as error:  # a run's error, answered with the call's run ids
        error.headers.update(headers)
        raise


async def _single(
    request: web.Request, run: PromptRun, stream: bool, headers: dict[str, str]
) -> web.StreamResponse:
    """One prompt's answer, straight from its run (resumable under the run's event ids)."""
    if run.ending is not None:  # its Idempotency-Key's run is no longer kept
        return await _respond_with_ending(request, run.ending, stream, run.params, headers)
    headers[HEADER] = follow_token(request, run.run_id, request[TENANT].name)
    runs = request.app[RUNS]
    if stream:
        record = await runs.get(run.run_id)
        return await stream_log(request, record, CompletionFrames(run.params, 0), headers)
    try:
        async with following(runs, run.run_id):
            terminal = await runs.result(run.run_id)
    except asyncio.CancelledError:
        request.app[METRICS].disconnects.inc()
        raise
    return _ended(terminal, run.params, headers)


def _ended(
    terminal: TerminalRecord, params: CompletionParams, headers: dict[str, str]
) -> web.Response:
    """The object of a run that ended so, or its error."""
    if terminal.status is RunStatus.COMPLETED and terminal.completion is not None:
        return _json(completion_object(terminal.completion, params), headers)
    error = terminal_error(terminal)
    error.headers.update(headers)
    raise error


async def _respond_with_ending(
    request: web.Request,
    terminal: TerminalRecord,
    stream: bool,
    params: CompletionParams,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Answer a repeat from the saved ending of a run no longer kept: the same object, or a
    stream rebuilt from it."""
    completed = terminal.status is RunStatus.COMPLETED and terminal.completion is not None
    if terminal.refused or not stream or not completed:
        return _ended(terminal, params, headers)
    payloads = replayed_chunks(terminal.completion, params)
    if terminal.error is not None:
        payloads.append(orjson.dumps({"error": terminal.error}))
    events = [(seq, payload, None, 0) for seq, payload in enumerate(payloads, 1)]
    writer = await SSEWriter.open(request, 0, headers, first=events)
    await writer.close()
    return writer.response


def _not_found(run_id: str) -> APIError:
    return APIError(404, f"No completion found with id '{run_id}'.", param="id", code="not_found")


async def _owned_completion(request: web.Request) -> RunRecord:
    """This tenant's legacy completion with this id; a 404 for anything else."""
    run_id = request.match_info["id"]
    try:
        record = await request.app[RUNS].get(run_id)
    except UnknownRun:
        raise _not_found(run_id) from None
    if record.tenant != request[PRINCIPAL].tenant or META not in record.meta:
        raise _not_found(run_id)
    return record


def completion_run_object(record: RunRecord) -> dict[str, Any]:
    """The `text_completion` object of a run with its `status`; the final one once it ended."""
    terminal = record.terminal
    if terminal is not None and terminal.completion is not None:
        body = completion_object(terminal.completion, _params(record))
    else:
        body = {
            "id": record.run_id,
            "object": "text_completion",
            "created": int(record.created),
            "model": record.model,
            "choices": [],
        }
    body["status"] = PUBLIC_STATUS[record.status]
    if terminal is not None and terminal.error is not None:
        body["error"] = terminal.error
    return body


@accepts_follow_token
async def retrieve_completion(request: web.Request) -> web.StreamResponse:
    """`GET /v1/completions/{id}`, or with `?stream=true` a resume of its stream (after
    `Last-Event-ID` or `starting_after`, as for a chat completion)."""
    stream = request.query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise invalid_request("stream", "'stream' must be true or false.")
    after = resume_point(request)
    record = await _owned_completion(request)
    if stream == "false":
        token = follow_token(request, record.run_id, record.tenant)
        return _json(completion_run_object(record) | {"follow_token": token}, {HEADER: token})
    resumes = request.app[METRICS].resumes
    outcome = "replayed" if record.status.is_terminal else "live"
    if nothing_after(record, after):
        resumes.labels(outcome).inc()
        return web.Response(status=204)
    try:
        frames = CompletionFrames(_params(record), after)
        response = await stream_log(request, record, frames, resume=True)
    except ResumeWindowExpired:
        resumes.labels("expired").inc()
        raise resume_window_expired(
            f"Events after {after} of '{record.run_id}' are no longer retained; "
            "retrieve the completion without stream=true for its final object."
        ) from None
    resumes.labels(outcome).inc()
    return response


async def cancel_completion(request: web.Request) -> web.Response:
    """`POST /v1/completions/{id}/cancel`: idempotent; answers the run's terminal status."""
    record = await cancelled(request, await _owned_completion(request))
    return _json(completion_run_object(record))
