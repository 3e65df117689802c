"""Where tenants live: the store protocol, and the tenants file (the default).

A store hands out the tenants document (tomlkit, comments and order kept) and applies an edit
to it as one step: read, change, check with the tenants file's parser, write. The file store
writes atomically (a temp file renamed over the old one, as `sluice keys` does) under an
advisory lock, so the gateway and `sluice keys` editing at once do not lose each other's edit.
"""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import tomlkit

from gateway.admin.tenant_doc import check
from policies.tenants import TenantsConfig
from policies.tenants_file import new_document, read_document, write_document

T = TypeVar("T")
Edit = Callable[[tomlkit.TOMLDocument], T]


class TenantStore(Protocol):
    label: str  # what parse errors and logs name: the file's path, or the Redis key

    async def document(self) -> tomlkit.TOMLDocument: ...

    async def edit(self, change: Edit[T]) -> tuple[T, TenantsConfig]:
        """Apply `change` to the current document, check it, store it; the change's result
        and the config the gateway now loads. A refused document is never stored."""
        ...


class FileTenantStore:
    """The `--tenants` file, edited in place."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.label = str(self.path)
        self._lock = asyncio.Lock()  # one edit at a time in this process; flock across them

    async def document(self) -> tomlkit.TOMLDocument:
        return await asyncio.to_thread(self._read)

    async def edit(self, change: Edit[T]) -> tuple[T, TenantsConfig]:
        async with self._lock:
            return await asyncio.to_thread(self._edit, change)

    def _read(self) -> tomlkit.TOMLDocument:
        return read_document(self.path) if self.path.exists() else new_document()

    def _edit(self, change: Edit[T]) -> tuple[T, TenantsConfig]:
        lock_file = self.path.with_name(f".{self.path.name}.lock")
        with open(lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            doc = self._read()
            result = change(doc)
            config = check(doc, self.label)
            write_document(self.path, doc)
        return result, config
