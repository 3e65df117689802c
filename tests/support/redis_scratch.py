"""A real Redis for tests that share state through it: a client and a key prefix of the test's
own, its keys deleted at the end (`SLUICE_TEST_REDIS_URL` points elsewhere)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextlib.asynccontextmanager
async def scratch_redis() -> AsyncIterator[tuple[Redis, str]]:
    """A Redis client and a key prefix of this test's own, its keys deleted at the end."""
    client = Redis.from_url(REDIS_URL)
    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}:"
    try:
        yield client, prefix
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
