"""`GET /playground`: a small chat page served by the gateway itself (plain HTML and JS in
gateway/playground/, no build step). It needs no credential to load; it asks for an API key to
call the API, as any client does."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

PLAYGROUND_DIR = Path(__file__).resolve().parent.parent / "playground"
PAGE_HEADERS = {
    # the page talks only to the gateway that served it, and runs only its own script
    "Content-Security-Policy": "default-src 'self'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def playground_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(PLAYGROUND_DIR / "index.html", headers=PAGE_HEADERS)


def add_playground_routes(app: web.Application) -> None:
    """The page at `/playground`, its script and style under `/playground/`."""
    app.router.add_get("/playground", playground_page)
    app.router.add_static("/playground/", PLAYGROUND_DIR)
