"""Probes and metrics: `/healthz` (process up), `/readyz` (a backend takes work), `/metrics`."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.app_keys import DRAIN, HEALTH, METRICS, REDIS


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """503 unless some backend can take work (as last probed, at most a second ago) and the
    state store answers (Redis is pinged; the in-process store always does); 503 `draining`
    once shutdown began, so a load balancer stops sending here (gateway/drain.py)."""
    backends = request.app[HEALTH].states()
    shared = request.app.get(REDIS)
    store = "in-process" if shared is None else "ok" if await shared.ping() else "unavailable"
    ready = any(backends.values()) and store != "unavailable"
    status = "ready" if ready else "unavailable"
    if request.app[DRAIN].draining:
        ready, status = False, "draining"
    return web.json_response(
        {"status": status, "backends": backends, "store": store},
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
