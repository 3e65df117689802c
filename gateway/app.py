"""The app factory: `create_app(settings)` wires routes, middlewares and backends."""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from adapters.base import Adapter
from adapters.catalog import Catalog
from adapters.openai_upstream import OpenAIUpstreamAdapter
from adapters.pool import PoolAdapter
from adapters.worker_client import WorkerAdapter
from gateway.app_keys import AUTH, CATALOG, HEALTH, METRICS, OPEN_STREAMS, SETTINGS
from gateway.backend_health import BackendHealth
from gateway.credentials import build_authenticator, watch_tenants_file
from gateway.handlers.chat import create_chat_completion
from gateway.handlers.health import healthz, metrics, readyz
from gateway.handlers.models import list_models, retrieve_model
from gateway.handlers.runs import cancel_chat_completion, retrieve_chat_completion
from gateway.local_worker import LocalWorker
from gateway.metrics import GatewayMetrics
from gateway.middlewares import add_request_id, authenticate, request_context
from gateway.pool_metrics import PoolCollector
from gateway.settings import DEFAULT_MODEL, Settings
from gateway.stores import shared_state
from gateway.supervisor import Supervisor

log = structlog.get_logger("sluice.app")


def _remote_adapters(settings: Settings) -> list[Adapter]:
    adapters: list[Adapter] = [
        WorkerAdapter(url, name=f"worker:{url}") for url in settings.worker_url
    ]
    for name, url in settings.upstreams():
        key = os.environ.get(f"SLUICE_UPSTREAM_API_KEY_{name.upper().replace('-', '_')}")
        adapters.append(OpenAIUpstreamAdapter(name, url, api_key=key))
    return adapters


def _backends(adapters: list[Adapter] | None):
    """cleanup_ctx: start local workers and adapters, fill the catalog; undo it all at exit."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        supervisor: Supervisor | None = None
        health: BackendHealth | None = None
        started: list[Adapter] = []
        try:
            chosen = adapters
            if chosen is None:
                chosen = _remote_adapters(settings)
                if settings.starts_local_workers:
                    model = settings.model or DEFAULT_MODEL
                    workers = [
                        LocalWorker(model, settings.device, settings.dtype, settings.max_body_bytes)
                        for _ in range(max(1, settings.workers))
                    ]
                    ready_within = settings.worker_start_timeout
                    supervisor = Supervisor(workers, app[METRICS], ready_within)
                    await asyncio.gather(*(w.start(ready_within) for w in workers))
                    supervisor.start()
                    local = [WorkerAdapter(w.url, name=w.name) for w in workers]
                    pool = PoolAdapter(
                        local,
                        "local",
                        stall_timeout=settings.stall_timeout,
                        on_stall=supervisor.restart,
                    )
                    chosen.insert(0, local[0] if len(local) == 1 else pool)
            for adapter in chosen:
                await adapter.start()
                started.append(adapter)
                await app[CATALOG].add(adapter)
            pools = [a for a in started if isinstance(a, PoolAdapter)]
            if pools:
                app[METRICS].registry.register(PoolCollector(pools))
            health = app[HEALTH] = BackendHealth(app[CATALOG].adapters)
            await health.start()
            log.info("backends ready", models=[m.id for m in app[CATALOG].models()])
            yield
        finally:
            if health is not None:
                await health.stop()
            for adapter in started:
                await adapter.close()
            if supervisor is not None:
                await supervisor.stop()

    return ctx


async def _cancel_open_streams(app: web.Application) -> None:
    """on_shutdown: end live streams now instead of waiting out the shutdown timeout."""
    for task in list(app[OPEN_STREAMS]):
        task.cancel()


def create_app(settings: Settings, adapters: list[Adapter] | None = None) -> web.Application:
    """The gateway app. `adapters` replaces the backends named in `settings` (tests)."""
    app = web.Application(
        middlewares=[request_context, authenticate], client_max_size=settings.max_body_bytes
    )
    app[SETTINGS] = settings
    app[METRICS] = GatewayMetrics()
    app[AUTH] = build_authenticator(settings)
    app[CATALOG] = Catalog()
    app[OPEN_STREAMS] = weakref.WeakSet()
    app.cleanup_ctx.append(_backends(adapters))
    app.cleanup_ctx.append(shared_state)  # after the backends: closed before them
    app.cleanup_ctx.append(watch_tenants_file)
    app.on_response_prepare.append(add_request_id)
    app.on_shutdown.append(_cancel_open_streams)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/chat/completions/{id}", retrieve_chat_completion)
    app.router.add_post("/v1/chat/completions/{id}/cancel", cancel_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
