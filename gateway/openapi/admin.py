"""The admin API's part of the OpenAPI document (gateway/openapi/document.py): its routes,
schemas and security scheme, as gateway/admin/routes.py answers (docs/admin.md)."""

from __future__ import annotations

from typing import Any

from gateway.openapi.document import JSON, _answer
from gateway.openapi.schemas import _nullable, _object, ref

_ERRORS = {
    400: "A malformed body or a bad value; `param` names the field.",
    401: "No valid admin credential.",
    403: "A valid credential that is not an admin's (a tenant's key or token).",
    404: "No such tenant or key; or the admin API is not enabled (no admin key, no `[jwt]`).",
    409: "The tenant exists already, tenants are not editable (no tenants file), or the stored "
    "tenants do not load.",
    415: "The body is not `application/json`.",
}
_SECURITY = [{"admin": []}]
_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
_SINCE = {
    "name": "since",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "A duration back from now (`24h`, `7d`, `30m`) or an ISO-8601 time.",
}


def _errors(*statuses: int) -> dict[str, Any]:
    content = {JSON: {"schema": ref("ErrorResponse")}}
    return {str(s): {"description": _ERRORS[s], "content": content} for s in statuses}


_READ = (401, 403, 404, 409)
_WRITE = (400, 401, 403, 404, 409, 415)


def _op(
    op_id: str, summary: str, ok: tuple[str, str, str], errors: tuple[int, ...], **more: Any
) -> dict[str, Any]:
    status, text, schema = ok
    responses = {status: _answer(text, {JSON: {"schema": ref(schema)}}), **_errors(*errors)}
    return {"operationId": op_id, "summary": summary, "security": _SECURITY, **more} | {
        "responses": responses
    }


def _body(schema: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {JSON: {"schema": ref(schema)}}}}


def _field_types() -> dict[str, Any]:
    """The tenants file's fields and their JSON types (docs/tenants-and-quotas.md)."""
    count = {"type": ["integer", "null"], "minimum": 1}
    duration = {"type": ["number", "string", "null"]}
    strings = {"type": ["array", "null"], "items": {"type": "string", "minLength": 1}}
    limits = ("rpm", "tpm", "max_concurrent", "max_tokens", "budget_tokens", "max_queued")
    deadlines = ("budget_period", "queue_timeout", "ttft_timeout", "inter_token_timeout")
    return {
        **dict.fromkeys(limits, count),
        **dict.fromkeys((*deadlines, "total_timeout"), duration),
        "models": strings,
        "tiers": strings,
        "default_tier": _nullable("string"),
        "weight": _nullable("number"),
        "budget_cost": {"type": ["number", "null"], "minimum": 0},
        "safety": _nullable("string"),
        "share_prefix_cache": _nullable("boolean"),
    }


def _schemas() -> dict[str, Any]:
    key_ref = _object(["id"], id={"type": "string"}, created=_nullable("string"))
    tenant = _object(
        ["object", "name", "keys"],
        object={"const": "tenant"},
        name={"type": "string"},
        keys={"type": "array", "items": key_ref},
    )
    tenant["description"] = (
        "The tenant's fields as in the tenants file (docs/tenants-and-quotas.md)."
    )
    fields = {
        "type": "object",
        "description": "Tenant fields as the tenants file takes them; null removes one. A "
        "value the file's loader would refuse (an unknown field, a `default_tier` not among "
        "`tiers`, `budget_tokens` without `budget_period`, an undefined `safety` policy) is a "
        "400 naming the field.",
        "properties": _field_types(),
    }
    name = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    new = {**fields, "required": ["name"], "properties": {"name": name, **_field_types()}}
    listed = {"type": "array", "items": {"type": "object"}}
    return {
        "AdminTenant": tenant,
        "AdminTenantFields": fields,
        "AdminNewTenant": new,
        "AdminTenantList": _object(["object", "data"], object={"const": "list"}, data=listed),
        "AdminKey": _object(
            ["object", "id", "tenant", "key"],
            object={"const": "key"},
            id={"type": "string"},
            tenant={"type": "string"},
            created={"type": "string"},
            key={"type": "string", "description": "The key itself: shown this once."},
        ),
        "AdminDeleted": _object(["object", "deleted"], object={"type": "string"}, deleted={}),
        "AdminList": _object(["object", "data"], object={"const": "list"}, data=listed),
    }


def _tenant_paths() -> dict[str, Any]:
    one, tenant = [_NAME], ("200", "The tenant.", "AdminTenant")
    key_id = {"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}
    tenants = ("200", "The tenants.", "AdminTenantList")
    return {
        "/admin/tenants": {
            "get": _op("adminListTenants", "Every tenant.", tenants, _READ),
            "post": _op(
                "adminCreateTenant",
                "Add a tenant.",
                ("201", "The tenant.", "AdminTenant"),
                _WRITE,
                **_body("AdminNewTenant"),
            ),
        },
        "/admin/tenants/{name}": {
            "get": _op("adminGetTenant", "One tenant.", tenant, _READ, parameters=one),
            "patch": _op(
                "adminUpdateTenant",
                "Set (or, with null, remove) fields.",
                tenant,
                _WRITE,
                parameters=one,
                **_body("AdminTenantFields"),
            ),
            "delete": _op(
                "adminDeleteTenant",
                "Remove a tenant and its keys.",
                ("200", "Deleted.", "AdminDeleted"),
                _READ,
                parameters=one,
            ),
        },
        "/admin/tenants/{name}/keys": {
            "post": _op(
                "adminCreateKey",
                "A new API key; the answer is the only time it is shown.",
                ("201", "The key.", "AdminKey"),
                _READ,
                parameters=one,
            )
        },
        "/admin/keys/{key_id}": {
            "delete": _op(
                "adminRevokeKey",
                "Revoke a key: refused from then on.",
                ("200", "Revoked.", "AdminDeleted"),
                _READ,
                parameters=[key_id],
            )
        },
    }


def _report_paths() -> dict[str, Any]:
    query = [
        {"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
        for n in ("tenant", "model")
    ]
    group_by = {"name": "group_by", "in": "query", "required": False, "schema": {"enum": ["day"]}}
    rows, records = ("200", "Rows.", "AdminList"), ("200", "Records.", "AdminList")
    answers = (400, 401, 403, 404)
    return {
        "/admin/usage": {
            "get": _op(
                "adminUsage",
                "Tokens and cost per tenant, model (and day).",
                rows,
                answers,
                parameters=[*query, _SINCE, group_by],
            )
        },
        "/admin/audit": {
            "get": _op(
                "adminAudit", "The audit log, oldest first.", records, answers, parameters=[_SINCE]
            )
        },
    }


def with_admin(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the admin routes, schemas and security scheme added."""
    document["paths"].update({**_tenant_paths(), **_report_paths()})
    components = document["components"]
    components["securitySchemes"]["admin"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An admin key (`--admin-key`) or a JWT whose `roles` claim holds "
        "`sluice-admin`.",
    }
    components["schemas"].update(_schemas())
    return document
