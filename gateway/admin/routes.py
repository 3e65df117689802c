"""The admin API's routes (design §11): thin handlers over AdminService, each behind the admin
credential check; domain errors become OpenAI-shaped answers here, in `_errors`."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson
import structlog
from aiohttp import web

from gateway.admin.service import AdminService, KeyNotFound, NoTenantsStore
from gateway.admin.tenant_doc import BadField, TenantExists, TenantNotFound
from gateway.admin.tenant_store_redis import EditConflict
from gateway.admin.usage import GROUP_BYS, usage_rows
from gateway.app_keys import ADMIN, LEDGER
from gateway.cli.usage import parse_since
from gateway.handlers.chat import read_json
from gateway.http.errors import APIError, invalid_request
from policies.tenants import TenantsFileError
from wire.limits import shown

log = structlog.get_logger("sluice.admin")
Handler = Callable[[web.Request, AdminService, str], Awaitable[web.Response]]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """The one translation of the admin domain's errors into HTTP answers."""
    try:
        yield
    except BadField as exc:
        raise invalid_request(exc.field, exc.message) from None
    except TenantNotFound as exc:
        raise APIError(
            404, f"No tenant named {shown(str(exc))}.", param="name", code="tenant_not_found"
        ) from None
    except TenantExists as exc:
        raise APIError(
            409, f"A tenant named {shown(str(exc))} exists.", param="name", code="tenant_exists"
        ) from None
    except KeyNotFound as exc:
        raise APIError(
            404, f"No key with id {shown(str(exc))}.", param="key_id", code="key_not_found"
        ) from None
    except NoTenantsStore as exc:
        raise APIError(409, str(exc), code="no_tenants_store") from None
    except (EditConflict, TenantsFileError) as exc:
        # NOTE: the stored tenants do not load (a hand edit) or kept moving: not the caller's
        raise APIError(409, str(exc), code="tenants_conflict") from None
    except OSError as exc:  # a read-only volume, a full disk: the operator's to fix
        log.error("tenants file not writable", error=str(exc))
        message = f"The tenants file cannot be written: {exc.strerror or exc}."
        raise APIError(500, message, type="server_error", code="tenants_not_writable") from None


def _guarded(handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The route, called with the service and who is calling once the credential checks out."""

    async def route(request: web.Request) -> web.Response:
        admin = request.app[ADMIN]
        who = admin.auth.identify(request.headers.get("Authorization"))
        with _errors():
            return await handler(request, admin.service, who)

    return route


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid_request(None, "The body must be a JSON object of tenant fields.")
    return body


def _since(request: web.Request) -> float | None:
    text = request.query.get("since")
    try:
        return None if text is None else parse_since(text)
    except argparse.ArgumentTypeError as exc:
        raise invalid_request("since", f"since: {exc}") from None


async def list_tenants(request: web.Request, admin: AdminService, who: str) -> web.Response:
    return _json({"object": "list", "data": await admin.tenants()})


async def create_tenant(request: web.Request, admin: AdminService, who: str) -> web.Response:
    fields = await _body(request)
    name = fields.pop("name", None)
    if name is None:
        raise invalid_request("name", "name is required", code="missing_required_parameter")
    return _json(await admin.create_tenant(who, name, fields), 201)


async def get_tenant(request: web.Request, admin: AdminService, who: str) -> web.Response:
    return _json(await admin.tenant(request.match_info["name"]))


async def update_tenant(request: web.Request, admin: AdminService, who: str) -> web.Response:
    fields = await _body(request)
    return _json(await admin.update_tenant(who, request.match_info["name"], fields))


async def delete_tenant(request: web.Request, admin: AdminService, who: str) -> web.Response:
    name = request.match_info["name"]
    await admin.delete_tenant(who, name)
    return _json({"object": "tenant.deleted", "name": name, "deleted": True})


async def create_key(request: web.Request, admin: AdminService, who: str) -> web.Response:
    name = request.match_info["name"]
    key, entry = await admin.create_key(who, name)
    # NOTE: the only answer that ever holds the key; the store keeps its hash
    body = {"object": "key", "id": entry.id, "tenant": name, "created": entry.created, "key": key}
    return _json(body, 201)


async def revoke_key(request: web.Request, admin: AdminService, who: str) -> web.Response:
    key = request.match_info["key_id"]
    tenant = await admin.revoke_key(who, key)
    return _json({"object": "key.deleted", "id": key, "tenant": tenant, "deleted": True})


async def usage(request: web.Request, admin: AdminService, who: str) -> web.Response:
    query = request.query
    group_by = query.get("group_by")
    if group_by is not None and group_by not in GROUP_BYS:
        raise invalid_request("group_by", f"group_by must be one of {', '.join(GROUP_BYS)}")
    records = request.app[LEDGER].read(since=_since(request), tenant=query.get("tenant"))
    rows = await usage_rows(records, query.get("model"), group_by)
    return _json({"object": "list", "data": rows})


async def audit(request: web.Request, admin: AdminService, who: str) -> web.Response:
    since = _since(request)
    records = [] if admin.audit is None else await admin.audit.read(since)
    return _json({"object": "list", "data": [r.to_dict() for r in records]})


def add_admin_routes(app: web.Application) -> None:
    """The admin API under `/admin/`; the page at `/admin` is added by gateway/admin/page.py."""
    router = app.router
    router.add_get("/admin/tenants", _guarded(list_tenants))
    router.add_post("/admin/tenants", _guarded(create_tenant))
    router.add_get("/admin/tenants/{name}", _guarded(get_tenant))
    router.add_patch("/admin/tenants/{name}", _guarded(update_tenant))
    router.add_delete("/admin/tenants/{name}", _guarded(delete_tenant))
    router.add_post("/admin/tenants/{name}/keys", _guarded(create_key))
    router.add_delete("/admin/keys/{key_id}", _guarded(revoke_key))
    router.add_get("/admin/usage", _guarded(usage))
    router.add_get("/admin/audit", _guarded(audit))
