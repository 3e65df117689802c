"""cleanup_ctx for the gateway's shared state: runs, quotas, idempotency keys, the usage ledger.

Without `--redis-url` everything is in-process (one replica) and usage goes to a JSONL file;
with it, all of it lives in Redis under `--redis-prefix`, so replicas share runs, limits and
keys exactly, and usage is one Redis Stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.keys import IDEMPOTENCY, LEDGER, METRICS, QUOTAS, RUNS, SETTINGS
from gateway.ledger import JsonlLedger, RedisLedger, default_usage_file
from gateway.runs.manager import RunManager
from gateway.runs.store_memory import MemoryRunStore
from gateway.runs.store_mirrored import MirroredRunStore
from gateway.runs.store_redis import RedisRunStore
from policies.idempotency import MemoryIdempotencyStore, RedisIdempotencyStore
from policies.quotas import MemoryQuotaStore
from policies.quotas_redis import RedisQuotaStore


async def shared_state(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    redis = None
    if settings.redis_url:
        # NOTE: a blocking pool: under a burst, a command waits for a free connection instead
        # of failing (the default pool raises past its size).
        pool = BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_max_connections, timeout=10
        )
        redis = Redis(connection_pool=pool)
    if redis is not None:
        prefix = settings.redis_prefix
        store: MemoryRunStore | MirroredRunStore = MirroredRunStore(
            RedisRunStore(redis, prefix, settings.run_max_events, settings.run_retention)
        )
        app[QUOTAS] = RedisQuotaStore(redis, prefix)
        app[IDEMPOTENCY] = RedisIdempotencyStore(redis, prefix)
        app[LEDGER] = RedisLedger(redis, prefix)
    else:
        store = MemoryRunStore(settings.run_max_events, settings.run_retention)
        app[QUOTAS] = MemoryQuotaStore()
        app[IDEMPOTENCY] = MemoryIdempotencyStore()
        app[LEDGER] = JsonlLedger(settings.usage_file or default_usage_file())
    runs = RunManager(
        store,
        app[METRICS],
        disconnect_grace=settings.disconnect_grace,
        confirm_timeout=settings.cancel_confirm_timeout,
        lease_ttl=settings.lease_ttl if redis is not None else None,
    )
    await runs.open()
    app[RUNS] = runs
    try:
        yield
    finally:
        await runs.close()  # runs settle into the ledger and quotas: those close after
        await app[LEDGER].close()
        if isinstance(store, MirroredRunStore):
            await store.close()
        if redis is not None:
            await redis.aclose()
