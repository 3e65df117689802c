"""CORS for the browser origins named by `--cors-origin` (none by default; `*` for any).

A page on an allowed origin may call the API with its own bearer key or follow a run by its
token: its preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered here, before
authentication, and every answer to it, streams included, names the origin and exposes the
headers a client reads (`x-follow-token`, `x-request-id`, the rate limits, …). An origin not on
the list gets no CORS headers at all, so its browser keeps the answers from it.
"""

from __future__ import annotations

from aiohttp import web

from gateway.app_keys import SETTINGS
from gateway.http.middlewares import Handler

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED_HEADERS = ", ".join(
    (
        "x-request-id",
        "x-follow-token",
        "x-sluice-run-id",
        "x-sluice-run-ids",
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-requests",
        "x-ratelimit-reset-tokens",
        "retry-after",
        "idempotent-replayed",
        "x-should-retry",
    )
)
MAX_AGE = "600"  # seconds a browser may keep a preflight's answer


def allowed_origin(request: web.Request) -> str | None:
    """The request's `Origin` when it is one the gateway serves, else None."""
    origin = request.headers.get("Origin")
    origins = request.app[SETTINGS].cors_origin
    if origin and (origin in origins or "*" in origins):
        return origin
    return None


@web.middleware
async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer an allowed origin's preflight with what it may send; anything else goes on."""
    if (
        request.method == "OPTIONS"
        and "Access-Control-Request-Method" in request.headers
        and allowed_origin(request) is not None
    ):
        headers = {
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Max-Age": MAX_AGE,
        }
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)
    return await handler(request)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the CORS headers of an answer to an allowed origin."""
    if not request.app[SETTINGS].cors_origin:
        return
    response.headers["Vary"] = "Origin"  # caches keep one answer per origin
    origin = allowed_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
