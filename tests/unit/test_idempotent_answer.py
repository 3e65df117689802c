"""A repeat with an Idempotency-Key after its run is no longer kept is answered from the ending
remembered with the key: the same object, or a stream rebuilt from it with the same content."""

from __future__ import annotations

import os
import uuid

import pytest
from redis.asyncio import Redis

from adapters.events import TextDelta
from gateway.app_keys import RUNS
from policies.idempotency import MemoryIdempotencyStore, RedisIdempotencyStore
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events, stream_text
from tests.support.waiting import until

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PIECES = ["Hé", "llo", " wörld", "!"]
RETENTION = 0.2  # seconds an ended run is kept: short, so the tests can outlive it


async def make_client(aiohttp_client, store_settings, script):
    adapter = ScriptedAdapter("scripted", script)
    app = gateway_app(adapters=[adapter], run_retention=RETENTION, **store_settings)
    return adapter, await aiohttp_client(app)


async def post(client, key: str | None = None, **body):
    headers = dict(AUTH)
    if key is not None:
        headers["Idempotency-Key"] = key
    return await client.post("/v1/chat/completions", json=chat_body(**body), headers=headers)


async def settled(client) -> None:
    """Until every run has settled (its ending is kept with its key by then)."""
    await until(lambda: not client.app[RUNS].drivers, "the runs to settle")


async def forget(client, run_id: str) -> None:
    """Until the run is no longer kept: past the retention, a new run sweeps the ended ones
    (Redis expires them by itself)."""

    async def gone() -> bool:
        await (await post(client)).read()
        status = (await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)).status
        return status == 404

    await until(gone, "the run to be forgotten", within=RETENTION * 50)


async def test_a_non_stream_repeat_after_the_run_is_gone_gets_the_same_object(
    aiohttp_client, store_settings
):
    adapter, client = await make_client(aiohttp_client, store_settings, text_script(PIECES))
    first = await post(client, key="k-1")
    original = await first.json()
    await settled(client)
    await forget(client, original["id"])
    calls = len(adapter.requests)
    again = await post(client, key="k-1")
    assert again.status == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert await again.json() == original
    assert len(adapter.requests) == calls  # answered without running anything


async def test_a_stream_repeat_after_the_run_is_gone_carries_the_same_content(
    aiohttp_client, store_settings
):
    _, client = await make_client(aiohttp_client, store_settings, text_script(PIECES))
    options = {"stream": True, "stream_options": {"include_usage": True}}
    first = sse_events(await (await post(client, key="k-2", **options)).read())
    await settled(client)
    await forget(client, first[0].json()["id"])
    resp = await post(client, key="k-2", **options)
    again = sse_events(await resp.read())
    assert resp.headers["idempotent-replayed"] == "true"
    payloads = [e.json() for e in again if e.data != "[DONE]"]
    assert stream_text(payloads) == stream_text([e.json() for e in first if e.data != "[DONE]"])
    assert payloads[0]["id"] == first[0].json()["id"]
    assert payloads[-1]["usage"] == first[-2].json()["usage"]
    assert [e.id for e in again[:-1]] == [str(i) for i in range(1, len(again))]
    assert again[-1].data == "[DONE]"


@pytest.mark.slow
async def test_a_repeat_of_a_cancelled_run_ends_as_it_ended(aiohttp_client, store_settings):
    def slow(request):
        return [TextDelta("a"), 5.0, TextDelta("b")]

    _, client = await make_client(aiohttp_client, store_settings, slow)
    resp = await post(client, key="k-3", stream=True)
    run_id = sse_events(await resp.content.readuntil(b"\n\n"))[0].json()["id"]
    await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    await resp.read()
    await settled(client)
    await forget(client, run_id)
    again = sse_events(await (await post(client, key="k-3", stream=True)).read())
    assert stream_text([e.json() for e in again[:-2]]) == "a"
    assert again[-2].json()["error"]["code"] == "cancelled"
    assert again[-1].data == "[DONE]"


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_stores_remember_an_answer_only_for_their_own_run(kind):
    client = None
    if kind == "memory":
        store = MemoryIdempotencyStore()
    else:
        client = Redis.from_url(REDIS_URL)
        store = RedisIdempotencyStore(client, prefix=f"sluice-test-{uuid.uuid4().hex[:12]}:")
    try:
        await store.claim("t", "k", "sha256:x", "run-1", 60)
        await store.remember("t", "k", "run-2", b'{"other":true}')  # not this key's run: ignored
        assert (await store.claim("t", "k", "sha256:x", "run-9", 60)).answer is None
        answer = '{"status":7,"completion":{"choices":[]},"error":null,"note":"café"}'.encode()
        await store.remember("t", "k", "run-1", answer)
        held = await store.claim("t", "k", "sha256:x", "run-9", 60)
        assert (held.run_id, held.answer) == ("run-1", answer)  # byte for byte, lists stay lists
    finally:
        if client is not None:
            keys = [key async for key in client.scan_iter(match=f"{store.prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


async def test_kept_endings_are_bounded_in_bytes_oldest_dropped_first():
    store = MemoryIdempotencyStore(max_answer_bytes=250)
    for i in range(4):
        await store.claim("t", f"k{i}", "sha256:x", f"run-{i}", 60)
        await store.remember("t", f"k{i}", f"run-{i}", b"x" * 100)
    held = [(await store.claim("t", f"k{i}", "sha256:x", "other", 60)) for i in range(4)]
    assert [h.run_id for h in held] == ["run-0", "run-1", "run-2", "run-3"]  # claims all kept
    assert [h.answer is not None for h in held] == [False, False, True, True]
    assert store.answer_bytes == 200
