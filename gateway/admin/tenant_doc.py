"""Edits of one tenant in a tenants document (tomlkit), checked by the tenants file's own parser.

Both stores (a file, or the same TOML text in Redis) edit through these functions, so an edit
can never write what `load_tenants` would refuse, and comments and order survive. Errors are
domain values here; the routes turn them into HTTP answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import Table

from policies.tenants import TenantsConfig, TenantsFileError, parse_text

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a bare TOML key: no quoting, no dots
# what the admin API never takes as a tenant field: keys are made and revoked by their routes
_NOT_EDITABLE = {"keys": "keys are made with POST /admin/tenants/{name}/keys", "name": None}


class TenantNotFound(LookupError):
    """No tenant of that name."""


class TenantExists(ValueError):
    """A tenant of that name is already there."""


@dataclass(slots=True)
class BadField(ValueError):
    """A field the tenants file's parser (or the API) refuses; `field` names it."""

    field: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True, frozen=True)
class Change:
    """What an edit changed: the fields' values before and after (never keys)."""

    before: dict[str, Any]
    after: dict[str, Any]


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadField("name", "a tenant name is 1 to 64 letters, digits, '_' or '-'")
    return name


def tables(doc: tomlkit.TOMLDocument) -> dict[str, Table]:
    return doc.get("tenants", {})


def fields_of(doc: tomlkit.TOMLDocument, name: str) -> dict[str, Any]:
    """The tenant's fields as plain values, its keys left out."""
    table = tables(doc).get(name)
    if table is None:
        raise TenantNotFound(name)
    return {k: v for k, v in table.unwrap().items() if k != "keys"}


def set_fields(
    doc: tomlkit.TOMLDocument, name: str, fields: dict[str, Any], *, create: bool = False
) -> Change:
    """Set (or, with a null, remove) the tenant's fields in `doc`; `create` adds the tenant."""
    exists = name in tables(doc)
    if create and exists:
        raise TenantExists(name)
    if not create and not exists:
        raise TenantNotFound(name)
    before = {} if create else fields_of(doc, name)
    table = _table(doc, name)
    for field, value in fields.items():
        if field in _NOT_EDITABLE:
            raise BadField(field, _NOT_EDITABLE[field] or "a tenant cannot be renamed")
        if value is None:
            if field in table:
                del table[field]
            continue
        try:
            table[field] = tomlkit.item(value)
        except (TypeError, ValueError):
            raise BadField(field, f"field {field!r}: not a value a tenants file can hold") from None
    after = fields_of(doc, name)
    changed = sorted(f for f in set(before) | set(after) if before.get(f) != after.get(f))
    return Change({f: before.get(f) for f in changed}, {f: after.get(f) for f in changed})


def delete(doc: tomlkit.TOMLDocument, name: str) -> Change:
    before = fields_of(doc, name)
    del doc["tenants"][name]
    return Change(before, {})


def check(doc: tomlkit.TOMLDocument, label: str) -> TenantsConfig:
    """The document as the gateway would load it; a refusal is a BadField naming the field."""
    try:
        return parse_text(tomlkit.dumps(doc), Path(label))
    except TenantsFileError as exc:
        # NOTE: the message starts with the file's path: the API's caller is told the rest
        message = str(exc).removeprefix(f"{label}: ")
        raise BadField(exc.field or "body", message) from None


def _table(doc: tomlkit.TOMLDocument, name: str) -> Table:
    if "tenants" not in doc:
        doc["tenants"] = tomlkit.table(is_super_table=True)
    if name not in doc["tenants"]:
        doc["tenants"][name] = tomlkit.table()
    return doc["tenants"][name]
