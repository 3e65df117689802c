"""Probes and metrics: `/healthz` (process up), `/readyz` (models can be served), `/metrics`."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from gateway.app_keys import CATALOG, DRAIN, HEALTH, METRICS, REDIS


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def model_states(app: web.Application) -> dict[str, bool]:
    """Per model id: whether a member of its backend can take work (as last probed)."""
    catalog, health = app[CATALOG], app[HEALTH]
    states = {}
    for info in catalog.models():
        adapter = catalog.lookup(info.id)
        states[info.id] = adapter is not None and health.ready(adapter)
    return states


def restarting(app: web.Application) -> dict[str, list[str]]:
    """Per model id with any: the members of its backend whose process is being restarted."""
    catalog, health = app[CATALOG], app[HEALTH]
    members = {}
    for info in catalog.models():
        adapter = catalog.lookup(info.id)
        if adapter is not None and (names := health.restarting(adapter)):
            members[info.id] = names
    return members


def breakers(app: web.Application) -> dict[str, dict[str, str]]:
    """Per model id with any: its members whose circuit breaker is not closed (`open`: out of
    routing for a cooldown; `half_open`: one request probes it), by member (design §6)."""
    catalog = app[CATALOG]
    found: dict[str, dict[str, str]] = {}
    for info in catalog.models():
        snapshot = getattr(catalog.lookup(info.id), "snapshot", None)
        rows = snapshot() if snapshot is not None else []
        if tripped := {r["member"]: r["breaker"] for r in rows if r["breaker"] != "closed"}:
            found[info.id] = tripped
    return found


async def readyz(request: web.Request) -> web.Response:
    """200 while some model can be served and the state store answers (Redis is pinged; the
    in-process store always does): `ready` when every model can, `degraded` when only some can
    (the body names them). 503 `unavailable` when none can or the store does not answer, and
    503 `draining` once shutdown began, so a load balancer stops sending here
    (gateway/http/drain.py). `restarting`, when some are, names per model the local workers
    being restarted: not ready from the moment the process exits until the new one serves.
    `breakers`, when some are not closed, says per model which members' are open or half-open
    (a model whose every member's breaker is open is not ready).

    NOTE: a replica that can serve nothing is taken out; one that serves some models is not,
    since what fails one model is often shared by every replica (an upstream, a remote worker)
    and taking them all out would stop the models that still work. A request for a model
    without a ready member is answered at once, 503 `overloaded` with retry-after, unless one
    is restarting: then it waits for it, `queued` (gateway/runs/admission.py)."""
    models = model_states(request.app)
    shared = request.app.get(REDIS)
    store = "in-process" if shared is None else "ok" if await shared.ping() else "unavailable"
    ready = any(models.values()) and store != "unavailable"
    status = "unavailable" if not ready else "ready" if all(models.values()) else "degraded"
    if request.app[DRAIN].draining:
        ready, status = False, "draining"
    body: dict[str, object] = {"status": status, "models": models, "store": store}
    if members := restarting(request.app):
        body["restarting"] = members
    if tripped := breakers(request.app):
        body["breakers"] = tripped
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; OpenMetrics (with the histograms' trace exemplars) when the scraper's
    Accept asks for it, as Prometheus does with exemplar storage on."""
    registry = request.app[METRICS].registry
    if "application/openmetrics-text" in request.headers.get("Accept", ""):
        body = openmetrics.generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": openmetrics.CONTENT_TYPE_LATEST})
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
