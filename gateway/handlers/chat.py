"""`POST /v1/chat/completions`: parse → open the run → answer from it."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from common.aiohttp_internals import ContentEncodingError
from gateway.app_keys import DRAIN, PRINCIPAL, SETTINGS
from gateway.handlers.answers import answer
from gateway.http.errors import APIError, invalid_request
from gateway.http.follow_access import HEADER, follow_token
from gateway.http.server import abandon_body
from gateway.protocol import parse_chat_request
from gateway.runs.life import RUN_ID_HEADER, RunLife
from wire.limits import shown


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    request.app[DRAIN].refuse_new_runs()  # shutting down: retry on another replica
    body = await read_json(request)
    chat = parse_chat_request(body)
    opened = await RunLife(request, chat, body).open()
    opened.headers[RUN_ID_HEADER] = opened.run_id  # before its first chunk (queued: design §12)
    if opened.ending is None:  # a run still kept: a browser may follow it by its token
        opened.headers[HEADER] = follow_token(request, opened.run_id, request[PRINCIPAL].tenant)
    return await answer(request, opened, chat)


def _unreadable_body(cause: BaseException | None) -> str:
    if isinstance(cause, ContentEncodingError):
        return "The request body could not be decoded: it is not valid for its Content-Encoding."
    return "The request body could not be read: its framing is not valid HTTP/1.1."


async def read_json(request: web.Request) -> object:
    """The request's body as JSON; refusals in OpenAI's shape, none of them quoting the body."""
    if request.content_type != "application/json":
        raise APIError(
            415,
            f"Unsupported Content-Type {shown(request.content_type or 'none')}; "
            "send the body as 'application/json'.",
            code="unsupported_media_type",
        )
    try:
        async with asyncio.timeout(request.app[SETTINGS].body_timeout or None):
            raw = await request.read()  # enforces the app's client_max_size (413)
    except TimeoutError:  # its own timeout, or `BodyOverdue`: refused as the oldest pending
        abandon_body(request)
        raise APIError(
            408,
            "The request body did not arrive in time.",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except web.RequestPayloadError as exc:
        # NOTE: the parser stops at a body it cannot decode, so the connection cannot carry
        # another request; aiohttp's text would name what it read
        abandon_body(request)
        raise APIError(
            400,
            _unreadable_body(exc.__cause__),
            code="invalid_body",
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
