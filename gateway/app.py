"""The app factory: `create_app(settings)` wires routes, middlewares and backends."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from adapters.base import Adapter
from adapters.catalog import Catalog
from adapters.pool import PoolAdapter
from adapters.retry_budget import RetryBudget
from common import aiohttp_internals
from gateway.admin.context import admin_ctx
from gateway.admin.page import add_admin_page
from gateway.admin.routes import add_admin_routes
from gateway.app_keys import (
    AUTH,
    CATALOG,
    DRAIN,
    FLOWS,
    HEALTH,
    METRICS,
    OPEN_STREAMS,
    PRICES,
    RETRY_BUDGET,
    RUNS,
    SETTINGS,
)
from gateway.backends.aliases import alias_adapters
from gateway.backends.from_settings import local_workers, member_adapters, routed_backends
from gateway.backends.health import BackendHealth
from gateway.backends.pool_metrics import PoolCollector, RetryCollector
from gateway.backends.supervisor import Supervisor
from gateway.credentials import build_authenticator, watch_tenants_file
from gateway.handlers.chat import create_chat_completion
from gateway.handlers.completions import (
    cancel_completion,
    create_completion,
    retrieve_completion,
)
from gateway.handlers.docs import openapi_json
from gateway.handlers.embeddings import create_embeddings
from gateway.handlers.health import healthz, metrics, readyz
from gateway.handlers.messages import count_tokens, create_message
from gateway.handlers.models import list_models, retrieve_model
from gateway.handlers.playground import add_playground_routes
from gateway.handlers.responses import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from gateway.handlers.runs import cancel_chat_completion, retrieve_chat_completion
from gateway.http.cors import add_cors_headers, preflight
from gateway.http.drain import SETTLE_MARGIN, Drain
from gateway.http.follow_access import follow_tokens_ctx
from gateway.http.middlewares import (
    add_request_id,
    add_route_header,
    authenticate,
    request_context,
)
from gateway.metrics import GatewayMetrics
from gateway.prices import unserved
from gateway.runs.flow_control import Flows
from gateway.settings import Settings
from gateway.state.stores import shared_state
from gateway.tracing.setup import install_tracing

log = structlog.get_logger("sluice.app")


def _backends(adapters: list[Adapter] | None):
    """cleanup_ctx: start local workers and members, route the models
    (gateway/backends/from_settings.py); undo it all at exit."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        supervisor: Supervisor | None = None
        health: BackendHealth | None = None
        started: list[Adapter] = []
        try:
            members = adapters
            routed = adapters
            if members is None:
                workers = local_workers(settings)
                if workers:
                    ready_within = settings.worker_start_timeout
                    supervisor = Supervisor(workers, app[METRICS], ready_within)
                    app[METRICS].know_workers(w.name for w in workers)
                    await asyncio.gather(*(w.start(ready_within) for w in workers))
                    supervisor.start()
                members = member_adapters(settings, workers)
            for adapter in members:
                await adapter.start()
                started.append(adapter)
            if routed is None:
                routed = await routed_backends(settings, started, supervisor, app[RETRY_BUDGET])
            for adapter in routed:
                if adapter not in started:
                    await adapter.start()  # a pool: its first probe of the members
                await app[CATALOG].add(adapter)
            app[METRICS].know_models(m.id for m in app[CATALOG].models())  # before the aliases
            if unpriced := unserved(app[PRICES], (m.id for m in app[CATALOG].models())):
                log.warning("prices for models no backend serves", models=unpriced)
            await _add_aliases(app)
            pools = [a for a in routed if isinstance(a, PoolAdapter)]
            if pools:
                app[METRICS].registry.register(PoolCollector(pools))
            health = app[HEALTH] = BackendHealth(app[CATALOG].adapters)
            await health.start()
            if supervisor is not None:  # after the pools' own (routed_backends): they go first
                supervisor.exit_listeners.append(health.member_exited)
                supervisor.restart_listeners.append(health.member_restarted)
            log.info("backends ready", models=[m.id for m in app[CATALOG].models()])
            yield
        finally:
            app[FLOWS].close()
            if health is not None:
                await health.stop()
            for adapter in started:
                await adapter.close()
            if supervisor is not None:
                await supervisor.stop()

    return ctx


async def _add_aliases(app: web.Application) -> None:
    """The config file's model aliases, over the backends the catalog routes (design §6); a
    ConfigError when one names a model nobody serves, or takes a served model's name."""
    metrics = app[METRICS]
    aliases = alias_adapters(
        app[SETTINGS].aliases(),
        app[CATALOG],
        budget=app[RETRY_BUDGET],
        on_outcome=lambda alias, outcome: metrics.fallbacks.labels(alias, outcome).inc(),
    )
    for alias in aliases:
        await app[CATALOG].add_alias(alias)
    metrics.know_aliases(a.alias.name for a in aliases)


async def _drain_then_close_streams(app: web.Application) -> None:
    """on_shutdown: finish the drain (gateway/http/drain.py) so streams get their runs' end and
    [DONE] before connections close, then end the streams still open now instead of waiting
    out the shutdown timeout. `sluice serve` drains on SIGTERM while still listening; an app
    shut down without that (tests, another runner) cancels its live runs here, without a wait."""
    drain = app[DRAIN]
    await drain.run(app.get(RUNS), app[OPEN_STREAMS], None if drain.draining else 0.0)
    for task in list(app[OPEN_STREAMS]):
        task.cancel()


def create_app(settings: Settings, adapters: list[Adapter] | None = None) -> web.Application:
    """The gateway app. `adapters` replaces the backends named in `settings` (tests)."""
    aiohttp_internals.check()  # the HTTP edge relies on aiohttp's private names: fail now
    app = web.Application(
        middlewares=[preflight, request_context, authenticate],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[PRICES] = settings.price_table()
    app[METRICS] = GatewayMetrics()
    app[RETRY_BUDGET] = RetryBudget(settings.retry_budget)
    app[METRICS].registry.register(RetryCollector(app[RETRY_BUDGET]))
    app[AUTH] = build_authenticator(settings)
    app[METRICS].know_tenants(app[AUTH].config.tenants.values())
    app[FLOWS] = Flows(app[METRICS], enabled=settings.scheduling == "fair")
    app[CATALOG] = Catalog()
    app[OPEN_STREAMS] = weakref.WeakSet()
    app[DRAIN] = Drain(settings.shutdown_timeout, settings.cancel_confirm_timeout + SETTLE_MARGIN)
    install_tracing(app, settings)  # with --otlp-endpoint only
    app.cleanup_ctx.append(_backends(adapters))
    app.cleanup_ctx.append(shared_state)  # after the backends: closed before them
    app.cleanup_ctx.append(follow_tokens_ctx)  # its secret may come from Redis
    app.cleanup_ctx.append(watch_tenants_file)
    app.cleanup_ctx.append(admin_ctx)  # after shared_state: in redis mode tenants live there
    app.on_response_prepare.append(add_request_id)
    app.on_response_prepare.append(add_route_header)
    app.on_response_prepare.append(add_cors_headers)
    app.on_shutdown.append(_drain_then_close_streams)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/chat/completions/{id}", retrieve_chat_completion)
    app.router.add_post("/v1/chat/completions/{id}/cancel", cancel_chat_completion)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_get("/v1/completions/{id}", retrieve_completion)
    app.router.add_post("/v1/completions/{id}/cancel", cancel_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{id}", retrieve_response)
    app.router.add_post("/v1/responses/{id}/cancel", cancel_response)
    app.router.add_delete("/v1/responses/{id}", delete_response)
    app.router.add_get("/v1/responses/{id}/input_items", list_input_items)
    app.router.add_post("/v1/embeddings", create_embeddings)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    add_playground_routes(app)
    add_admin_routes(app)
    add_admin_page(app)
    return app
