"""The worker's HTTP API (docs/worker-api.md): thin routes over `WorkerService`.

Routes parse and delegate; api.py and generate_body.py know the field names; errors become
OpenAI-shaped bodies here, in one place, and never carry a stack trace. A closed connection
aborts its request: the handler is cancelled (the CLI runs aiohttp with `handler_cancellation`)
or its next write fails, and either way the stream generator is closed, which aborts the request
in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common import aiohttp_internals
from wire import api
from wire.api import BadRequest
from wire.embed_body import parse_embed
from wire.generate_body import parse_generate
from workers.app_keys import CONFIG, METRICS, REGISTRY, SERVICE, TRACER
from workers.async_engine import SHUTTING_DOWN, DuplicateRequest, EmbeddingFailed, EngineNotRunning
from workers.config import WorkerConfig
from workers.service import LoadedModel, WorkerService

log = structlog.get_logger("sluice.worker.http")

NDJSON = "application/x-ndjson"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return _json(api.error_body(message, code, param, type_), status)


def _not_ready() -> web.Response:
    return _error(503, "the worker is not ready", "not_ready")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place an error becomes an OpenAI-shaped body: aiohttp's own (413 for a body
    over the limit, 404, 405) and, logged without a trace, an unexpected 500."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = "request_too_large" if e.status == 413 else f"http_{e.status}"
        return _error(e.status, e.reason, code)
    except Exception as e:
        log.error("request failed", path=request.path, error=type(e).__name__)
        return _error(500, "internal error", "internal_error")


async def _read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise BadRequest("the body is not valid JSON", None, "invalid_json") from None


async def health(request: web.Request) -> web.Response:
    if not request.app[SERVICE].is_ready:
        return _json({"status": "loading"}, 503)
    return _json({"status": "ok"})


async def model(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return _json(service.model_info()) if service.is_ready else _not_ready()


async def stats(request: web.Request) -> web.Response:
    snapshot = request.app[SERVICE].stats()
    if snapshot is None:
        return _not_ready()
    return _json(
        {
            "waiting": snapshot.waiting,
            "running": snapshot.running,
            "kv_blocks_used": snapshot.kv_blocks_used,
            "kv_blocks_total": snapshot.kv_blocks_total,
            "prefix_cache_hits": snapshot.prefix_cache_hits,
            "prefix_cache_queries": snapshot.prefix_cache_queries,
            "steps": snapshot.steps_total,
            "max_num_seqs": snapshot.max_num_seqs,
            "preemptions": snapshot.preemptions,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def abort(request: web.Request) -> web.Response:
    try:
        body = await _read_json(request)
    except BadRequest as e:
        return _error(400, e.message, e.code, e.param)
    request_id = body.get("request_id") if isinstance(body, dict) else None
    if not isinstance(request_id, str) or not request_id:
        return _error(400, "request_id must be a non-empty string", "invalid_type", "request_id")
    return _json({"aborted": request.app[SERVICE].abort(request_id)})


async def generate(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    if not service.is_ready:
        return _not_ready()
    try:
        parsed = parse_generate(await _read_json(request))
        engine_request = await service.prepare(parsed)
    except BadRequest as e:
        return _error(400, e.message, e.code, e.param)
    events = service.generate(engine_request)
    if (tracer := request.app.get(TRACER)) is not None:  # its span: the caller's child
        model_id = service.model_info()["id"]
        events = tracer.traced(request.headers, engine_request.request_id, model_id, events)
    async with contextlib.aclosing(events):
        try:  # the `start` line comes first; a refused request fails before the 200
            first = await anext(events)
        except DuplicateRequest:
            return _error(
                400, "request_id is already running", "duplicate_request_id", "request_id"
            )
        except EngineNotRunning:
            return _not_ready()
        response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            await _stream(response, first, events)
        except ConnectionResetError:  # the client went away (before the headers, too: a
            # gateway that closes a stream it began and will not read); closing `events` aborts
            log.info("client disconnected", request_id=engine_request.request_id)
            return response
        except Exception as e:  # after the 200: one error line, logged here without a trace
            if not response.prepared:
                raise
            log.error("stream failed", request_id=engine_request.request_id, error=type(e).__name__)
            line = api.ErrorLine("internal_error", "the stream failed")
            with contextlib.suppress(ConnectionResetError):
                await response.write(api.encode(line))
    await response.write_eof()
    return response


async def embed(request: web.Request) -> web.Response:
    """Unit vectors of the body's inputs, in one JSON answer (no stream: nothing to cancel
    mid-way but the call)."""
    service = request.app[SERVICE]
    if not service.is_ready:
        return _not_ready()
    try:
        answer = await service.embed(parse_embed(await _read_json(request)))
    except BadRequest as e:
        return _error(400, e.message, e.code, e.param)
    except EmbeddingFailed as e:
        return _error(503 if e.code == SHUTTING_DOWN else 500, str(e), e.code, None)
    return _json(answer.wire())


async def count(request: web.Request) -> web.Response:
    """The prompt tokens a `/v1/generate` body would take (same body, same rendering); nothing
    is generated."""
    service = request.app[SERVICE]
    if not service.is_ready:
        return _not_ready()
    try:
        tokens = await service.count(parse_generate(await _read_json(request)))
    except BadRequest as e:
        return _error(400, e.message, e.code, e.param)
    return _json({"input_tokens": tokens})


async def _stream(
    response: web.StreamResponse, first: api.Line, events: AsyncIterator[api.Line]
) -> None:
    await response.write(api.encode(first))
    async for line in events:
        await response.write(api.encode(line))


async def _service_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start loading in the background (the port is open, /health says 503 meanwhile)."""
    service = app[SERVICE]
    task = asyncio.create_task(service.start())
    yield
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await service.stop()


async def _end_streams(app: web.Application) -> None:
    """On shutdown, before aiohttp waits for handlers: live streams end with an error line."""
    await app[SERVICE].stop()


def create_worker_app(
    config: WorkerConfig, *, loaded: LoadedModel | None = None
) -> web.Application:
    """The worker app. `loaded` skips loading (tests reuse a model already in memory)."""
    aiohttp_internals.check()  # the tested aiohttp range (pyproject), before the model loads
    app = web.Application(middlewares=[_errors], client_max_size=config.max_body_bytes)
    registry = CollectorRegistry()
    service = WorkerService(config, registry, loaded)
    app[CONFIG] = config
    app[REGISTRY] = registry
    app[METRICS] = service.metrics
    app[SERVICE] = service
    app.cleanup_ctx.append(_service_ctx)
    if config.otlp_endpoint is not None:
        from workers.tracing import GenerateTracer  # NOTE: only now: off costs no import

        app[TRACER] = GenerateTracer(config.otlp_endpoint)
        app.on_cleanup.append(lambda app: app[TRACER].close())
    app.on_shutdown.append(_end_streams)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/model", model)
    app.router.add_get("/v1/stats", stats)
    app.router.add_post("/v1/generate", generate)
    app.router.add_post("/v1/abort", abort)
    app.router.add_post("/v1/embed", embed)
    app.router.add_post("/v1/count", count)
    return app
