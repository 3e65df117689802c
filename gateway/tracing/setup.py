"""Turning tracing on for an app (`--otlp-endpoint`), and the hooks the run code calls.

Off, nothing here imports OpenTelemetry and the run code holds None where a trace would be:
no span, no context, no exporter thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web

from gateway.app_keys import TRACER
from gateway.runs.manager import RunManager
from gateway.settings import Settings
from gateway.tracing import RunTrace
from policies.tenants import Tenant


def install_tracing(app: web.Application, settings: Settings) -> None:
    """With an endpoint: the tracer, and (first in, so last out) its final export once every
    run has settled at shutdown."""
    if settings.otlp_endpoint is None:
        return
    from gateway.tracing.run_trace import OtelRunTracer  # NOTE: only now: off costs no import

    app[TRACER] = OtelRunTracer(settings.otlp_endpoint, settings.trace_sample_ratio)

    async def flush_at_exit(app: web.Application) -> AsyncIterator[None]:
        yield
        await app[TRACER].close()

    app.cleanup_ctx.insert(0, flush_at_exit)


def run_trace(
    app: web.Application, headers: Mapping[str, str], tenant: Tenant, body: Mapping[str, Any]
) -> RunTrace | None:
    """The trace a new run gets (None when tracing is off)."""
    tracer = app.get(TRACER)
    return None if tracer is None else tracer.prepare(headers, tenant.trace_content, body)


def note(runs: RunManager, run_id: str, name: str, **attributes: str | int) -> None:
    """An event on the span of a run driven here (a resume); nothing when it is untraced."""
    driver = runs.drivers.get(run_id)
    if driver is not None and driver.spec.trace is not None:
        driver.spec.trace.event(name, **attributes)
