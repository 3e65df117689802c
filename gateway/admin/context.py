"""cleanup_ctx of the admin API: who may call it, where tenants live, where audit records go.

- `--tenants-store file` (the default): the `--tenants` file is the source of truth; the API
  edits it in place, and the file watcher (gateway/credentials.py) reloads every gateway that
  reads it. Audit records go to the file beside it. Without `--tenants`, tenants cannot be
  edited (the API's tenant routes answer 409 `no_tenants_store`).
- `--tenants-store redis`: Redis is the source of truth, shared by every replica. At start, a
  Redis that holds no tenants yet gets the `--tenants` file (the first push); from then on the
  file is ignored (a change to it is logged). Audit records go to a Redis Stream.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from gateway.admin.audit import AuditLog, FileAuditLog, RedisAuditLog, audit_path
from gateway.admin.auth import AdminAuth
from gateway.admin.service import Admin, AdminService
from gateway.admin.tenant_store import FileTenantStore
from gateway.admin.tenant_store_redis import RedisTenantStore
from gateway.admin.tenant_sync import first_load, follow_versions
from gateway.app_keys import ADMIN, AUTH, REDIS, SETTINGS
from gateway.credentials import apply_tenants, on_sighup
from gateway.tasks import stop_tasks

log = structlog.get_logger("sluice.admin")


async def admin_ctx(app: web.Application) -> AsyncIterator[None]:
    """After shared_state (it needs the Redis client in redis mode)."""
    settings = app[SETTINGS]
    apply = functools.partial(apply_tenants, app)
    auth = AdminAuth(settings.admin_key, app[AUTH])
    if settings.tenants_store != "redis":
        store = FileTenantStore(settings.tenants) if settings.tenants else None
        audit: AuditLog | None = FileAuditLog(audit_path(settings.tenants)) if store else None
        app[ADMIN] = Admin(auth, AdminService(store, audit, apply))
        yield
        return
    redis = app[REDIS].redis
    shared = RedisTenantStore(redis, settings.redis_prefix, settings.tenants or "redis")
    version = await first_load(shared, settings.tenants, apply)
    service = AdminService(shared, RedisAuditLog(redis, settings.redis_prefix), apply)
    app[ADMIN] = Admin(auth, service)
    wake = asyncio.Event()
    follow = follow_versions(shared, apply, wake, version, settings.tenants)
    task = asyncio.create_task(follow, name="tenants follow")
    try:
        with on_sighup(wake.set):  # SIGHUP: re-read Redis now
            yield
    finally:
        await stop_tasks([task])
