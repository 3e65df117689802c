"""What the admin API does to tenants and keys: one edit of the store, then the new tenants
applied on this replica at once, then one audit record. Routes parse and delegate here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tomlkit

from gateway.admin import tenant_doc
from gateway.admin.audit import AuditLog, AuditRecord
from gateway.admin.auth import AdminAuth
from gateway.admin.tenant_store import TenantStore
from policies.auth import key_id
from policies.tenants import KeyEntry, TenantsConfig
from policies.tenants_file import add_key, remove_key


class NoTenantsStore(RuntimeError):
    """Tenants cannot be edited: no --tenants file and not --tenants-store redis."""


class KeyNotFound(LookupError):
    """No key with that id."""


def tenant_view(doc: tomlkit.TOMLDocument, name: str) -> dict[str, Any]:
    """A tenant as the API shows it: its fields, and its keys by id (never a hash)."""
    table = tenant_doc.tables(doc).get(name)
    if table is None:
        raise tenant_doc.TenantNotFound(name)
    keys = [_key_view(item) for item in table.get("keys", [])]
    return {"object": "tenant", "name": name, **tenant_doc.fields_of(doc, name), "keys": keys}


def _key_view(item: Any) -> dict[str, str | None]:
    """A stored key (a hash, or `{hash, created}`) as its id and creation time."""
    digest, created = (
        (item.get("hash"), item.get("created")) if isinstance(item, dict) else (item, None)
    )
    return {"id": key_id(str(digest)), "created": None if created is None else str(created)}


class AdminService:
    def __init__(
        self,
        store: TenantStore | None,
        audit: AuditLog | None,
        apply: Callable[[TenantsConfig], None],
    ) -> None:
        self.store = store
        self.audit = audit
        self._apply = apply  # swaps the new tenants in on this replica (others follow)

    def _store(self) -> TenantStore:
        if self.store is None:
            raise NoTenantsStore("tenants are not editable: start with --tenants FILE")
        return self.store

    async def tenants(self) -> list[dict[str, Any]]:
        doc = await self._store().document()
        return [tenant_view(doc, name) for name in tenant_doc.tables(doc)]

    async def tenant(self, name: str) -> dict[str, Any]:
        return tenant_view(await self._store().document(), name)

    async def create_tenant(self, who: str, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        tenant_doc.check_name(name)
        return await self._change(
            who,
            "tenant.create",
            name,
            lambda d: tenant_doc.set_fields(d, name, fields, create=True),
        )

    async def update_tenant(self, who: str, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        return await self._change(
            who, "tenant.update", name, lambda d: tenant_doc.set_fields(d, name, fields)
        )

    async def delete_tenant(self, who: str, name: str) -> None:
        await self._change(who, "tenant.delete", name, lambda d: tenant_doc.delete(d, name))

    async def create_key(self, who: str, name: str) -> tuple[str, KeyEntry]:
        """A new key for an existing tenant; the caller shows it once, only its hash is kept."""

        def edit(doc: tomlkit.TOMLDocument) -> tuple[str, KeyEntry]:
            tenant_doc.fields_of(doc, name)  # TenantNotFound: keys are for existing tenants
            return add_key(doc, name)

        (key, entry), config = await self._store().edit(edit)
        self._apply(config)
        await self._record(AuditRecord(who, "key.create", entry.id, name, {}, {"id": entry.id}))
        return key, entry

    async def revoke_key(self, who: str, key: str) -> str:
        """Remove the key with id `key`; the tenant it belonged to."""

        def edit(doc: tomlkit.TOMLDocument) -> str:
            tenant = remove_key(doc, key, self._store().label)
            if tenant is None:
                raise KeyNotFound(key)
            return tenant

        tenant, config = await self._store().edit(edit)
        self._apply(config)
        await self._record(AuditRecord(who, "key.revoke", key, tenant, {"id": key}, {}))
        return tenant

    async def _change(
        self, who: str, action: str, name: str, edit: Callable[[tomlkit.TOMLDocument], Any]
    ) -> dict[str, Any]:
        change, config = await self._store().edit(edit)
        self._apply(config)
        if action != "tenant.update" or change.before != change.after:  # a no-op is no change
            await self._record(AuditRecord(who, action, name, name, change.before, change.after))
        return {} if action == "tenant.delete" else await self.tenant(name)

    async def _record(self, record: AuditRecord) -> None:
        if self.audit is not None:
            await self.audit.append(record)


@dataclass(slots=True, frozen=True)
class Admin:
    """The admin API's parts, one app key: who may call, and what it does."""

    auth: AdminAuth
    service: AdminService
