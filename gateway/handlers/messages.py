"""The Anthropic Messages routes (design §4): a message is a run, answered by a third renderer.

`POST /v1/messages` opens a run through the same RunLife as a chat completion (idempotency keys,
quotas, deadlines, the safety window, the pool, cancellation on disconnect); its answer is
Anthropic's `message` object or its named-event stream. `POST /v1/messages/count_tokens` counts
a request's prompt. Errors on both are Anthropic's (gateway/anthropic/errors.py).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
from aiohttp import web

from gateway.anthropic.count import COUNT_SOURCE_HEADER, count_prompt
from gateway.anthropic.render import message_object
from gateway.anthropic.request import chat_body, messages_request, renamed
from gateway.anthropic.stream import stream_message
from gateway.app_keys import CATALOG, DRAIN, HEALTH, METRICS, MODEL_LABEL, RUNS, TENANT
from gateway.handlers.answers import following
from gateway.handlers.chat import read_json
from gateway.http.errors import APIError, invalid_request, model_not_found, terminal_error
from gateway.protocol import parse_chat_request
from gateway.runs.life import RUN_ID_HEADER, RunLife
from gateway.runs.replays import idempotent_run_gone
from gateway.runs.status import RunStatus

COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice"})


def _json(body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def create_message(request: web.Request) -> web.StreamResponse:
    """`POST /v1/messages`: stream the run's events, or wait for its `message`."""
    request.app[DRAIN].refuse_new_runs()
    body = await read_json(request)
    try:
        chat_json, chat = messages_request(body)
        life = RunLife(request, chat, chat_json, run_id=f"msg_{uuid.uuid4().hex}")
    except APIError as exc:
        raise renamed(exc) from None
    opened = await life.open()
    if opened.ending is not None:  # its Idempotency-Key's run is no longer kept
        raise idempotent_run_gone(opened.run_id, "message")
    opened.headers[RUN_ID_HEADER] = opened.run_id
    runs = request.app[RUNS]
    record = await runs.get(opened.run_id)
    if chat.stream:
        try:
            return await stream_message(request, record, opened.headers)
        except APIError as exc:  # refused by the backend before its first event
            raise renamed(exc) from None
    try:
        async with following(runs, record.run_id):
            terminal = await runs.result(record.run_id)
    except asyncio.CancelledError:
        request.app[METRICS].disconnects.inc()
        raise
    if terminal.status is not RunStatus.COMPLETED or terminal.completion is None:
        error = renamed(terminal_error(terminal))
        error.headers.update(opened.headers)
        raise error
    message = message_object(record.run_id, terminal.completion_object())
    return _json(message, opened.headers)


async def count_tokens(request: web.Request) -> web.Response:
    """`POST /v1/messages/count_tokens`: the prompt's tokens as the model's backend counts
    them, else as the gateway estimates them; the header says which
    (gateway/anthropic/count.py)."""
    body = await read_json(request)
    if isinstance(body, dict):
        extra = next((name for name in body if name not in COUNT_FIELDS), None)
        if extra is not None:
            param = extra if len(extra) <= 40 else None
            raise invalid_request(param, "Extra inputs are not permitted.")
        body = {**body, "max_tokens": 1}  # not a field of a count; the chat parser needs one
    try:
        chat = parse_chat_request(chat_body(body))
    except APIError as exc:
        raise renamed(exc) from None
    adapter = request.app[CATALOG].lookup(chat.model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(chat.model)
    request[MODEL_LABEL] = chat.model
    if not request[TENANT].allows_model(chat.model):
        raise APIError(403, f"Your key has no access to model '{chat.model}'.", param="model")
    try:
        counted = await count_prompt(adapter, chat, request.app[HEALTH].ready(adapter))
    except APIError as exc:
        raise renamed(exc) from None
    headers = {COUNT_SOURCE_HEADER: counted.source}
    return _json({"input_tokens": counted.input_tokens}, headers)
