"""Idempotency keys (design §5): key rules, body fingerprints, and the claim contract that both
stores keep — one winner per (tenant, key), tenants apart, expiry, conditional release."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import pytest
from redis.asyncio import Redis

from policies.idempotency import (
    MAX_KEY_LEN,
    MemoryIdempotencyStore,
    RedisIdempotencyStore,
    body_fingerprint,
    validate_key,
)

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
FP = body_fingerprint({"model": "m", "messages": []})


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class MemoryBackend:
    """One process: every store() is the same store, its time a fake clock."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self._store = MemoryIdempotencyStore(clock=self.clock)

    def store(self) -> MemoryIdempotencyStore:
        return self._store

    async def pass_time(self, seconds: float) -> None:
        self.clock.now += seconds


class RedisBackend:
    """A real Redis under a prefix of its own: every store() is a new "replica", time is real."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self.prefix = f"sluice-test-{uuid.uuid4().hex[:12]}:"

    def store(self) -> RedisIdempotencyStore:
        return RedisIdempotencyStore(self.client, prefix=self.prefix)

    async def pass_time(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # NOTE: Redis expires keys on its own clock: real time


@contextlib.asynccontextmanager
async def redis_backend_for_test():
    client = Redis.from_url(REDIS_URL)
    backend = RedisBackend(client)
    try:
        yield backend
    finally:
        keys = [key async for key in client.scan_iter(match=f"{backend.prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    if request.param == "memory":
        yield MemoryBackend()
        return
    async with redis_backend_for_test() as redis_backend:
        yield redis_backend


@pytest.fixture
async def redis_backend():
    async with redis_backend_for_test() as backend:
        yield backend


# --- keys and fingerprints ---


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        ("", "empty"),
        ("k" * 256, "256 characters"),
        ("abc\n", "position 3"),
        ("\x00", "position 0"),
        ("tab\there", "position 3"),
        ("caf\u00e9", "position 3"),
        ("\x7f", "position 0"),
    ],
)
def test_bad_keys_are_refused_with_what_is_wrong(raw, complaint):
    with pytest.raises(ValueError, match=complaint):
        validate_key(raw)


ALL_PRINTABLE = "".join(map(chr, range(0x20, 0x7F)))


@pytest.mark.parametrize("raw", ["k", "k" * MAX_KEY_LEN, ALL_PRINTABLE])
def test_printable_keys_up_to_255_chars_are_accepted(raw):
    assert validate_key(raw) == raw


def test_fingerprint_ignores_key_order_and_whitespace_of_the_original():
    import json

    a = json.loads('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1}')
    b = json.loads('{"n":1,"messages":[{"content":"hi","role":"user"}],"model":"m"}')
    assert body_fingerprint(a) == body_fingerprint(b)
    assert body_fingerprint(a).startswith("sha256:")
    assert len(body_fingerprint(a)) == len("sha256:") + 64


def test_fingerprint_differs_for_different_bodies():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    others = [
        {**base, "model": "m2"},
        {**base, "messages": [{"role": "user", "content": "hi!"}]},
        {**base, "temperature": 0},
        {"model": "m"},
    ]
    prints = {body_fingerprint(base), *(body_fingerprint(o) for o in others)}
    assert len(prints) == 1 + len(others)


# --- the claim contract ---


async def test_first_claim_is_fresh_and_a_repeat_gets_the_stored_claim(backend):
    store = backend.store()
    first = await store.claim("acme", "k1", FP, "run-1", ttl=60)
    assert (first.run_id, first.fingerprint, first.fresh) == ("run-1", FP, True)
    other = body_fingerprint({"different": True})
    again = await store.claim("acme", "k1", other, "run-2", ttl=60)
    assert (again.run_id, again.fingerprint, again.fresh) == ("run-1", FP, False)
    assert again.created == pytest.approx(first.created)


async def test_tenants_do_not_see_each_others_keys(backend):
    store = backend.store()
    a = await store.claim("acme", "same-key", FP, "run-a", ttl=60)
    b = await store.claim("globex", "same-key", FP, "run-b", ttl=60)
    assert (a.run_id, a.fresh) == ("run-a", True)
    assert (b.run_id, b.fresh) == ("run-b", True)
    assert (await store.claim("globex", "same-key", FP, "x", ttl=60)).run_id == "run-b"


async def test_a_tenant_name_with_a_colon_does_not_collide(backend):
    store = backend.store()
    await store.claim("a:b", "c", FP, "run-1", ttl=60)
    assert (await store.claim("a", "b:c", FP, "run-2", ttl=60)).fresh


async def test_a_claim_expires_after_its_ttl(backend):
    store = backend.store()
    await store.claim("acme", "k", FP, "run-1", ttl=0.2)
    assert not (await store.claim("acme", "k", FP, "run-2", ttl=0.2)).fresh
    await backend.pass_time(0.3)
    after = await store.claim("acme", "k", FP, "run-3", ttl=60)
    assert (after.run_id, after.fresh) == ("run-3", True)


async def test_release_forgets_the_claim_only_for_its_own_run(backend):
    store = backend.store()
    await store.claim("acme", "k", FP, "run-1", ttl=60)
    await store.release("acme", "k", "run-other")
    assert (await store.claim("acme", "k", FP, "run-2", ttl=60)).run_id == "run-1"
    await store.release("acme", "k", "run-1")
    retry = await store.claim("acme", "k", FP, "run-2", ttl=60)
    assert (retry.run_id, retry.fresh) == ("run-2", True)
    await store.release("acme", "unknown", "run-1")  # nothing to forget: a no-op


async def test_redis_keys_hold_no_raw_client_text(redis_backend):
    backend = redis_backend
    secret = "customer-order-4711/" + "x" * 200
    await backend.store().claim("acme", secret, FP, "run-1", ttl=60)
    [key] = [k.decode() async for k in backend.client.scan_iter(match=f"{backend.prefix}*")]
    assert key.startswith(f"{backend.prefix}idem:acme:")
    assert "customer" not in key
    assert len(key.rsplit(":", 1)[1]) == 64
    assert 0 < await backend.client.pttl(key) <= 60_000


async def test_racing_claims_have_exactly_one_winner(backend):
    store = backend.store()
    claims = await asyncio.gather(
        *(store.claim("acme", "race", FP, f"run-{i}", ttl=60) for i in range(20))
    )
    assert sum(c.fresh for c in claims) == 1
    winner = next(c for c in claims if c.fresh).run_id
    assert {c.run_id for c in claims} == {winner}


async def test_two_redis_replicas_racing_agree_on_one_winner(redis_backend):
    backend = redis_backend
    clients = [Redis.from_url(REDIS_URL) for _ in range(2)]
    try:
        replicas = [RedisIdempotencyStore(c, prefix=backend.prefix) for c in clients]
        for round_ in range(5):
            claims = await asyncio.gather(
                *(
                    replicas[i % 2].claim("acme", f"race-{round_}", FP, f"run-{i}", ttl=60)
                    for i in range(20)
                )
            )
            assert sum(c.fresh for c in claims) == 1
            assert len({c.run_id for c in claims}) == 1
    finally:
        for c in clients:
            await c.aclose()


async def test_memory_store_drops_expired_claims_as_new_ones_come():
    clock = FakeClock()
    store = MemoryIdempotencyStore(clock=clock)
    for i in range(100):
        await store.claim("acme", f"k{i}", FP, f"run-{i}", ttl=10)
    assert len(store) == 100
    clock.now += 5
    await store.claim("acme", "long", FP, "run-long", ttl=100)
    assert len(store) == 101
    clock.now += 6  # the first hundred are expired; "long" is not
    await store.claim("acme", "new", FP, "run-new", ttl=10)
    assert len(store) == 2
    assert not (await store.claim("acme", "long", FP, "x", ttl=10)).fresh


async def test_memory_store_expiry_survives_release_and_reclaim():
    clock = FakeClock()
    store = MemoryIdempotencyStore(clock=clock)
    await store.claim("acme", "k", FP, "run-1", ttl=10)
    await store.release("acme", "k", "run-1")
    await store.claim("acme", "k", FP, "run-2", ttl=100)
    clock.now += 20  # the first claim's expiry passes; the second claim must stay
    assert (await store.claim("acme", "k", FP, "x", ttl=10)).run_id == "run-2"


@pytest.mark.parametrize("ttl", [0, -1.0])
async def test_a_non_positive_ttl_is_refused(backend, ttl):
    with pytest.raises(ValueError, match="ttl"):
        await backend.store().claim("acme", "k", FP, "run-1", ttl=ttl)
