"""`GET /admin`: the admin page, plain HTML and JS in gateway/admin/page/ (no build step, nothing
fetched from elsewhere). Like the playground it needs no credential to load; it asks for an
admin key, keeps it in the tab's sessionStorage, and calls the admin API with it."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from gateway.admin.auth import not_enabled
from gateway.app_keys import ADMIN
from gateway.handlers.playground import PAGE_HEADERS

PAGE_DIR = Path(__file__).resolve().parent / "page"


async def admin_page(request: web.Request) -> web.FileResponse:
    if not request.app[ADMIN].auth.enabled:
        raise not_enabled()  # as every /admin route: no admin API, no page
    return web.FileResponse(PAGE_DIR / "index.html", headers=PAGE_HEADERS)


def add_admin_page(app: web.Application) -> None:
    """The page at `/admin`, its script and style under `/admin/assets/`."""
    app.router.add_get("/admin", admin_page)
    app.router.add_static("/admin/assets/", PAGE_DIR)
