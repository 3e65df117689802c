"""Runs one chat completion against its adapter: as an SSE stream or as one JSON object."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import orjson
import structlog
from aiohttp import web

from adapters.base import Adapter, BackendFailed, BackendRejected, BackendUnavailable
from adapters.events import ErrorEvent, Event
from adapters.requests import ChatRequest
from adapters.to_openai import ChunkRenderer, CompletionBuilder
from gateway.accounting import ResponseAccounting
from gateway.errors import APIError, from_backend, upstream_failed
from gateway.keys import METRICS, OPEN_STREAMS, PRINCIPAL, REQUEST_ID, SETTINGS, STARTED
from gateway.sse import SSEWriter

log = structlog.get_logger("sluice.completions")
BACKEND_ERRORS = (BackendRejected, BackendUnavailable, BackendFailed)


def _error_body(event: ErrorEvent) -> dict:
    return {"message": event.message, "type": event.type, "param": None, "code": event.code}


async def _first_batch(events: AsyncIterator[list[Event]]) -> list[Event]:
    """The first batch, with backend failures still answerable as HTTP errors."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return []
    except BACKEND_ERRORS as exc:
        raise from_backend(exc) from None


async def stream_completion(
    request: web.Request, chat: ChatRequest, adapter: Adapter, completion_id: str
) -> web.StreamResponse:
    app = request.app
    accounting = ResponseAccounting(app[METRICS], chat.model, request[STARTED])
    renderer = ChunkRenderer(completion_id, chat.model)
    async with aclosing(adapter.stream(chat, completion_id)) as events:
        try:
            first = await _first_batch(events)
            roles = [renderer.role(i) for i in range(chat.n)]
            first_payloads = _render(renderer, accounting, first, roles)
            writer = await SSEWriter.open(
                request, app[SETTINGS].ping_interval, first=first_payloads
            )
        except (ConnectionError, asyncio.CancelledError):  # gone before the first token
            app[METRICS].disconnects.inc()
            accounting.close("disconnect")
            _log_end(request, completion_id, accounting, "disconnect")
            raise
        app[OPEN_STREAMS].add(asyncio.current_task())
        app[METRICS].active_streams.inc()
        outcome = None
        try:
            async for batch in events:
                if accounting.error is not None:
                    break
                await writer.send(_render(renderer, accounting, batch))
            if accounting.error is not None:
                await writer.send_error(_error_body(accounting.error))
            elif chat.include_usage and accounting.usage is not None:
                await writer.send([renderer.usage(accounting.usage)])
            await writer.close()
        except BACKEND_ERRORS as exc:
            await writer.send_error(from_backend(exc).body()["error"])
            await writer.close()
            outcome = "error"
        except (ConnectionError, asyncio.CancelledError):
            outcome = "disconnect"
            app[METRICS].disconnects.inc()
            writer.abandon()
            raise
        finally:
            app[METRICS].active_streams.dec()
            accounting.close(outcome)
            _log_end(request, completion_id, accounting, outcome)
    return writer.response


def _render(
    renderer: ChunkRenderer,
    accounting: ResponseAccounting,
    batch: list[Event],
    payloads: list[bytes] | None = None,
) -> list[bytes]:
    """The chunk payloads of one batch, recorded as sent (they are written next)."""
    accounting.observe(batch)
    payloads = payloads or []
    for event in batch:
        chunk = renderer.render(event)
        if chunk is not None:
            payloads.append(chunk)
    return payloads


async def complete(
    request: web.Request, chat: ChatRequest, adapter: Adapter, completion_id: str
) -> web.Response:
    accounting = ResponseAccounting(request.app[METRICS], chat.model, request[STARTED])
    builder = CompletionBuilder(chat.n)
    outcome = None
    try:
        async with aclosing(adapter.stream(chat, completion_id)) as events:
            async for batch in events:
                accounting.observe(batch)
                if accounting.error is not None:
                    raise upstream_failed()
                for event in batch:
                    builder.add(event)
    except BACKEND_ERRORS as exc:
        outcome = "error"
        raise from_backend(exc) from None
    except APIError:
        outcome = "error"
        raise
    except asyncio.CancelledError:
        outcome = "disconnect"
        request.app[METRICS].disconnects.inc()
        raise
    finally:
        accounting.close(outcome)
        _log_end(request, completion_id, accounting, outcome)
    body = builder.build(completion_id, chat.model, int(time.time()))
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _log_end(
    request: web.Request, completion_id: str, accounting: ResponseAccounting, outcome: str | None
) -> None:
    usage = accounting.usage
    principal = request.get(PRINCIPAL)
    log.info(
        "completion end",
        request_id=request[REQUEST_ID],
        completion_id=completion_id,
        tenant=principal.tenant if principal else None,
        model=accounting.model,
        finish_reason=outcome or accounting.finish_reason,
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        sent_tokens=accounting.sent_tokens,
        ttft_s=round(accounting.first_token_at - accounting.started, 4)
        if accounting.first_token_at
        else None,
        e2e_s=round(time.monotonic() - accounting.started, 4),
    )
