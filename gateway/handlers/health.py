"""Probes and metrics: `/healthz` (process up), `/readyz` (a backend takes work), `/metrics`."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.keys import CATALOG, METRICS


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    adapters = request.app[CATALOG].adapters
    states = await asyncio.gather(*(a.ready() for a in adapters))
    ready = any(states)
    return web.json_response(
        {
            "status": "ready" if ready else "unavailable",
            "backends": {a.name: ok for a, ok in zip(adapters, states, strict=True)},
        },
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
