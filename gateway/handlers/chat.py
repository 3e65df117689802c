"""`POST /v1/chat/completions`: parse, check the tenant's policies, start a run (or find the one
an earlier request with the same Idempotency-Key started), answer from it."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from gateway import idempotent
from gateway.admission import admit, cap_max_tokens, check_model, prompt_estimate, settlement
from gateway.errors import APIError, invalid_request, model_not_found
from gateway.idempotent import idempotency_key
from gateway.keys import CATALOG, MODEL_LABEL, PRINCIPAL, RUNS, SETTINGS, STARTED, TENANT
from gateway.protocol import parse_chat_request
from gateway.runs.manager import new_run_id
from gateway.streaming import respond_with_result, stream_run


async def read_json(request: web.Request) -> object:
    if request.content_type != "application/json":
        raise APIError(
            415,
            f"Unsupported Content-Type {request.content_type or 'none'!r}; "
            "send the body as 'application/json'.",
            code="unsupported_media_type",
        )
    raw = await request.read()  # enforces the app's client_max_size (413)
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
    app, tenant, principal = request.app, request[TENANT], request[PRINCIPAL]
    adapter = app[CATALOG].lookup(chat.model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(chat.model)
    request[MODEL_LABEL] = chat.model
    check_model(request, tenant, chat.model)
    cap_max_tokens(tenant, chat)
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
        replay = await idempotent.claim(request, tenant.name, key, body, run_id)
        if replay is not None:
            return await _answer(request, replay, chat.stream, idempotent.REPLAYED)
    try:
        admission = await admit(request, tenant, chat, run_id)
        await app[RUNS].start(
            chat,
            adapter,
            tenant.name,
            started=request[STARTED],
            deadlines=app[SETTINGS].deadlines(tenant.deadlines),
            run_id=run_id,
            principal=principal.key_id,
            on_settled=settlement(app, principal, admission, prompt_estimate(chat)),
        )
    except BaseException:
        if key is not None:
            await asyncio.shield(idempotent.release(request, tenant.name, key, run_id))
        raise
    return await _answer(request, run_id, chat.stream)


async def _answer(
    request: web.Request, run_id: str, stream: bool, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    if stream:
        return await stream_run(request, run_id, headers=headers)
    return await respond_with_result(request, run_id, headers)
