"""`POST /v1/chat/completions`: parse, route to the model's adapter, start a run, answer from it."""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.errors import APIError, invalid_request, model_not_found
from gateway.keys import CATALOG, MODEL_LABEL, PRINCIPAL, RUNS, SETTINGS, STARTED
from gateway.protocol import parse_chat_request
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
    chat = parse_chat_request(await read_json(request))
    adapter = request.app[CATALOG].lookup(chat.model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(chat.model)
    request[MODEL_LABEL] = chat.model
    param = adapter.unsupported_param(chat)
    if param is not None:
        raise invalid_request(
            param,
            f"'{param}' is not supported by model '{chat.model}'.",
            code="unsupported_parameter",
        )
    driver = await request.app[RUNS].start(
        chat,
        adapter,
        request[PRINCIPAL].tenant,
        started=request[STARTED],
        deadlines=request.app[SETTINGS].deadlines(),
    )
    if chat.stream:
        return await stream_run(request, driver.run_id)
    return await respond_with_result(request, driver.run_id)
