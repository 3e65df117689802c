"""`POST /v1/chat/completions`: parse, check the tenant's policies, start a run (or find the one
an earlier request with the same Idempotency-Key started), answer from it."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from adapters.base import Adapter
from adapters.requests import ChatRequest
from gateway import replays
from gateway.admission import (
    admit,
    cap_max_tokens,
    check_model,
    principal_label,
    prompt_estimate,
    settlement,
)
from gateway.answers import respond_with_ending, respond_with_result, stream_run
from gateway.app_keys import (
    CATALOG,
    DEFERRED,
    HEALTH,
    MODEL_LABEL,
    PRINCIPAL,
    QUOTAS,
    RUNS,
    SETTINGS,
    STARTED,
    TENANT,
)
from gateway.errors import APIError, invalid_request, model_not_found, overloaded
from gateway.http_server import abandon_body
from gateway.protocol import parse_chat_request
from gateway.replays import idempotency_key
from gateway.runs.driver import RunDriver
from gateway.runs.manager import new_run_id


async def read_json(request: web.Request) -> object:
    if request.content_type != "application/json":
        raise APIError(
            415,
            f"Unsupported Content-Type {request.content_type or 'none'!r}; "
            "send the body as 'application/json'.",
            code="unsupported_media_type",
        )
    try:
        async with asyncio.timeout(request.app[SETTINGS].body_timeout or None):
            raw = await request.read()  # enforces the app's client_max_size (413)
    except TimeoutError:
        abandon_body(request)
        raise APIError(
            408,
            "The request body did not arrive in time.",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request(
            None,
            "We could not parse the JSON body of your request: it is not valid JSON.",
            code="invalid_json",
        ) from None


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    chat = parse_chat_request(body)
    app, tenant = request.app, request[TENANT]
    adapter = app[CATALOG].lookup(chat.model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(chat.model)
    request[MODEL_LABEL] = chat.model
    check_model(request, tenant, chat.model)
    if not app[HEALTH].ready(adapter):
        raise overloaded(f"No backend for model '{chat.model}' is ready; retry shortly.")
    named = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    cap_max_tokens(tenant, chat, named or "max_tokens")
    param = adapter.unsupported_param(chat)
    if param is not None:
        raise invalid_request(
            param,
            f"'{param}' is not supported by model '{chat.model}'.",
            code="unsupported_parameter",
        )
    run_id = new_run_id()
    key = idempotency_key(request)
    if key is not None:
        replay = await replays.claim(request, tenant.name, key, body, run_id)
        if replay is not None and replay.answer is not None:
            return await respond_with_ending(
                request, replay.answer, chat.stream, chat.include_usage, replays.REPLAYED
            )
        if replay is not None:
            return await _answer(request, replay.run_id, chat.stream, replays.REPLAYED)
    begin = asyncio.ensure_future(_admit_and_start(request, chat, adapter, run_id, key))
    try:
        # NOTE: shielded: a client that goes away here (the handler is cancelled) must not strand
        # an admission, which would hold a concurrency slot for the slot TTL and a reservation
        # that is never refunded. The admission completes; its run is then cancelled, and
        # settles (refund, usage record) like any other.
        try:
            await asyncio.shield(begin)
        except asyncio.CancelledError:
            begin.add_done_callback(_cancel_orphan)
            raise
    except BaseException:
        if key is not None:
            release = app[DEFERRED].run(
                "idempotency release", lambda: replays.release(request, tenant.name, key, run_id)
            )
            await asyncio.shield(release)
        raise
    return await _answer(request, run_id, chat.stream)


async def _admit_and_start(
    request: web.Request, chat: ChatRequest, adapter: Adapter, run_id: str, key: str | None
) -> RunDriver:
    app, tenant, principal = request.app, request[TENANT], request[PRINCIPAL]
    admission = await admit(request, tenant, chat, run_id)
    try:
        return await app[RUNS].start(
            chat,
            adapter,
            tenant.name,
            started=request[STARTED],
            deadlines=app[SETTINGS].deadlines(tenant.deadlines),
            run_id=run_id,
            principal=principal_label(principal),
            on_settled=settlement(app, principal, admission, prompt_estimate(chat), key),
        )
    except BaseException:
        if admission is not None:  # no run will settle it
            await app[DEFERRED].run("quota release", lambda: app[QUOTAS].release(admission, 0))
        raise


def _cancel_orphan(begin: asyncio.Future[RunDriver]) -> None:
    """The run of a request whose client left before following it: nobody will read it."""
    if not begin.cancelled() and begin.exception() is None:
        begin.result().cancel("disconnect")


async def _answer(
    request: web.Request, run_id: str, stream: bool, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    if stream:
        return await stream_run(request, run_id, headers=headers)
    return await respond_with_result(request, run_id, headers)
