"""cleanup_ctx for the gateway's shared state: runs, quotas, idempotency keys, the usage ledger.

Without `--redis-url` everything is in-process (one replica) and usage goes to a JSONL file;
with it, all of it lives in Redis under `--redis-prefix`, so replicas share runs, limits and
keys exactly, and usage is one Redis Stream (with the JSONL file as its fallback while Redis is
away). How each part rides out a Redis outage is in gateway/state/store_health.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.app_keys import (
    DEFERRED,
    IDEMPOTENCY,
    LEDGER,
    METRICS,
    OPENER,
    QUOTAS,
    REDIS,
    RUNS,
    SETTINGS,
)
from gateway.runs.manager import RunManager
from gateway.settings import Settings
from gateway.state.ledger import JsonlLedger, RedisLedger, default_usage_file
from gateway.state.quotas_redis import RedisQuotaStore
from gateway.state.redis_client import SharedRedis
from gateway.state.redis_open import RedisOpener
from gateway.state.run_store_memory import MemoryRunStore
from gateway.state.run_store_mirrored import MIRROR_RETENTION, MirroredRunStore
from gateway.state.run_store_redis import RedisRunStore
from gateway.state.store_health import DeferredWrites, StoreHealth
from policies.idempotency import MemoryIdempotencyStore, RedisIdempotencyStore
from policies.quotas import MemoryQuotaStore


def _memory_store(settings: Settings, retention: float) -> MemoryRunStore:
    return MemoryRunStore(
        settings.run_max_events,
        retention,
        max_event_bytes=settings.run_max_event_bytes,
        retention_bytes=settings.run_retention_bytes,
    )


async def shared_state(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    replica = uuid.uuid4().hex[:12]
    usage_file = JsonlLedger(
        settings.usage_file or default_usage_file(redis=settings.redis_url is not None)
    )
    shared: SharedRedis | None = None
    if settings.redis_url:
        shared = app[REDIS] = SharedRedis(
            settings.redis_url, settings.redis_max_connections, settings.redis_timeout
        )
        redis, prefix, health = shared.redis, settings.redis_prefix, shared.health
        retention = min(MIRROR_RETENTION, settings.run_retention)
        store: MemoryRunStore | MirroredRunStore = MirroredRunStore(
            RedisRunStore(
                redis, prefix, settings.run_max_events, settings.run_retention, replica=replica
            ),
            health,
            _memory_store(settings, retention),
        )
        app[METRICS].retained_bytes.labels("runs").set_function(store.local.bytes_held)
        quotas = app[QUOTAS] = RedisQuotaStore(redis, prefix)
        keys = app[IDEMPOTENCY] = RedisIdempotencyStore(redis, prefix)
        app[OPENER] = RedisOpener(keys, quotas, store)
        app[LEDGER] = RedisLedger(redis, prefix, fallback=usage_file)
    else:
        health = StoreHealth()  # in-process: always there
        store = _memory_store(settings, settings.run_retention)
        app[METRICS].retained_bytes.labels("runs").set_function(store.bytes_held)
        app[QUOTAS] = MemoryQuotaStore()
        keys = app[IDEMPOTENCY] = MemoryIdempotencyStore(
            max_answer_bytes=settings.run_retention_bytes
        )
        app[METRICS].retained_bytes.labels("idempotency").set_function(lambda: keys.answer_bytes)
        app[LEDGER] = usage_file
    app[METRICS].store_up.set_function(lambda: float(health.available))
    deferred = app[DEFERRED] = DeferredWrites(health)
    runs = RunManager(
        store,
        app[METRICS],
        disconnect_grace=settings.disconnect_grace,
        confirm_timeout=settings.cancel_confirm_timeout,
        lease_ttl=settings.lease_ttl if shared is not None else None,
        owner=replica,
        health=health,
        outage_grace=settings.redis_outage_grace,
    )
    await runs.open()
    app[RUNS] = runs
    try:
        yield
    finally:
        await runs.close()  # runs settle into the ledger and quotas: those close after
        await deferred.close()
        await app[LEDGER].close()
        if isinstance(store, MirroredRunStore):
            await store.close()
        if shared is not None:
            await shared.close()
