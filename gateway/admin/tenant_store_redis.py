"""Tenants in Redis (`--tenants-store redis`): the tenants document's TOML text under
`{prefix}tenants:doc` and a version counter under `{prefix}tenants:version`.

An edit is a compare-and-set on the version (a Lua script), retried when another replica wrote
in between. Replicas notice a change by polling the version (see `follow_versions`).
"""

from __future__ import annotations

import tomlkit
from redis.asyncio import Redis

from gateway.admin.tenant_doc import check
from gateway.admin.tenant_store import Edit, T
from policies.tenants import TenantsConfig
from policies.tenants_file import new_document

# KEYS: doc, version. ARGV: new text, the version it was read at ("" = any). The new version,
# or -1 when the version moved since the read.
_CAS = """
local current = redis.call('GET', KEYS[2]) or '0'
if ARGV[2] ~= '' and current ~= ARGV[2] then return -1 end
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('INCR', KEYS[2])
"""
_ATTEMPTS = 8


class EditConflict(RuntimeError):
    """Other replicas kept writing between this one's read and write."""


class RedisTenantStore:
    def __init__(self, redis: Redis, prefix: str, label: str = "redis") -> None:
        self.redis = redis  # owned by the caller
        self.doc_key = f"{prefix}tenants:doc"
        self.version_key = f"{prefix}tenants:version"
        # parse errors name this; a [jwt] file path is relative to it (the --tenants file's)
        self.label = label

    async def version(self) -> int:
        return int(await self.redis.get(self.version_key) or 0)

    async def text(self) -> tuple[str | None, str]:
        """The stored TOML text (None: nothing stored yet) and its version."""
        text, version = await self.redis.mget(self.doc_key, self.version_key)
        return (None if text is None else text.decode()), (version or b"0").decode()

    async def document(self) -> tomlkit.TOMLDocument:
        text, _ = await self.text()
        return new_document() if text is None else tomlkit.parse(text)

    async def config(self) -> TenantsConfig | None:
        """What the gateway loads; None when nothing was pushed yet."""
        text, _ = await self.text()
        return None if text is None else check(tomlkit.parse(text), self.label)

    async def edit(self, change: Edit[T]) -> tuple[T, TenantsConfig]:
        for _ in range(_ATTEMPTS):
            text, version = await self.text()
            doc = new_document() if text is None else tomlkit.parse(text)
            result = change(doc)
            config = check(doc, self.label)
            if await self._store(tomlkit.dumps(doc), version) >= 0:
                return result, config
        raise EditConflict("the tenants kept changing in Redis; try again")

    async def push(self, text: str, *, only_if_empty: bool = False) -> bool:
        """Store a whole tenants file's text (checked first); with `only_if_empty`, only when
        Redis holds none yet. True when it was stored."""
        check(tomlkit.parse(text), self.label)
        if only_if_empty:
            return await self._store(text, "0") >= 0
        return await self._store(text, "") >= 0

    async def _store(self, text: str, version: str) -> int:
        keys = [self.doc_key, self.version_key]
        return int(await self.redis.eval(_CAS, len(keys), *keys, text, version))
