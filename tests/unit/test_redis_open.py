"""Opening a run against a real Redis in one script: the key's claim, the admission and the
record are taken together, or (a key held by another run, a refused admission) none is."""

from __future__ import annotations

import os
import uuid

import pytest
from redis.asyncio import Redis

from gateway.state.quotas_redis import RedisQuotaStore
from gateway.state.redis_open import KeyClaim, RedisOpener
from gateway.state.run_store import RunRecord, UnknownRun
from gateway.state.run_store_mirrored import MirroredRunStore
from gateway.state.run_store_redis import RedisRunStore
from policies.idempotency import RedisIdempotencyStore
from policies.quotas import QuotaExceeded, QuotaLimits, QuotaRequest

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ONE_AT_A_TIME = QuotaLimits(rpm=10, max_concurrent=1)


@pytest.fixture
async def parts():
    """The opener and the three stores it writes through, under a key prefix of this test's."""
    client = Redis.from_url(REDIS_URL)
    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}:"
    keys = RedisIdempotencyStore(client, prefix)
    quotas = RedisQuotaStore(client, prefix)
    runs = MirroredRunStore(RedisRunStore(client, prefix=prefix))
    yield RedisOpener(keys, quotas, runs), keys, quotas, runs
    await runs.close()
    found = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if found:
        await client.delete(*found)
    await client.aclose()


def record(run_id: str) -> RunRecord:
    return RunRecord(run_id, tenant="acme", model="m", created=0.0)


def claim(run_id: str, key: str = "key-1", body: str = "sha256:a") -> KeyClaim:
    return KeyClaim("acme", key, body, run_id, ttl=60.0)


def quota(run_id: str) -> QuotaRequest:
    return QuotaRequest("acme", run_id, 10, ONE_AT_A_TIME)


async def test_a_new_run_is_claimed_admitted_and_recorded_at_once(parts):
    opener, keys, quotas, runs = parts
    opening = await opener.open(claim("run-1"), quota("run-1"), record("run-1"))
    assert opening.held is None
    assert opening.admission is not None and opening.admission.run_id == "run-1"
    assert opening.admission.headers["x-ratelimit-remaining-requests"] == "9"
    assert (await runs.shared.get("run-1")).tenant == "acme"  # in Redis
    assert (await runs.get("run-1")).tenant == "acme"  # and mirrored
    again = await keys.claim("acme", "key-1", "sha256:a", "run-2", 60.0)
    assert not again.fresh and again.run_id == "run-1"
    with pytest.raises(QuotaExceeded) as refused:  # its concurrency slot is taken
        await quotas.admit(quota("run-2"))
    assert refused.value.limit == "concurrency"


async def test_a_key_held_by_another_run_takes_nothing(parts):
    opener, keys, quotas, runs = parts
    await keys.claim("acme", "key-1", "sha256:a", "run-1", 60.0)
    opening = await opener.open(claim("run-2"), quota("run-2"), record("run-2"))
    assert opening.held is not None and opening.held.run_id == "run-1"
    assert opening.admission is None
    with pytest.raises(UnknownRun):
        await runs.get("run-2")
    assert (await quotas.admit(quota("run-3"))).run_id == "run-3"  # no slot was taken


async def test_a_refused_admission_gives_the_key_back_and_records_nothing(parts):
    opener, keys, quotas, runs = parts
    await quotas.admit(quota("run-0"))  # the one slot
    with pytest.raises(QuotaExceeded) as refused:
        await opener.open(claim("run-1"), quota("run-1"), record("run-1"))
    assert refused.value.limit == "concurrency"
    assert refused.value.headers["retry-after"]
    with pytest.raises(UnknownRun):
        await runs.shared.get("run-1")
    assert (await keys.claim("acme", "key-1", "sha256:a", "run-2", 60.0)).fresh


async def test_without_a_key_or_limits_only_the_record_is_written(parts):
    opener, _, _, runs = parts
    opening = await opener.open(None, None, record("run-1"))
    assert opening.admission is None and opening.held is None
    assert (await runs.shared.get("run-1")).model == "m"
    with pytest.raises(ValueError, match="exists"):
        await opener.open(None, None, record("run-1"))
