"""Idempotency keys and the usage ledger through the real app, with tenants from a tenants file
and a scripted upstream: replays (streamed and not, finished and live, raced), refusals, tenant
scoping, and one ledger record per run however it ends. Every test runs on the in-process store
(JSONL ledger) and on a real Redis (the ledger is a Redis Stream)."""

from __future__ import annotations

import asyncio
import os
from contextlib import aclosing
from pathlib import Path

import pytest
import tomlkit
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from adapters.events import Aborted, ErrorEvent, Finish, TextDelta, Usage
from gateway.app import create_app
from gateway.app_keys import RUNS
from gateway.settings import Settings
from gateway.state.ledger import JsonlLedger, RedisLedger, UsageRecord
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter
from tests.support.gateway import chat_body, sse_events, stream_text
from tests.support.waiting import until

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PIECES = [f"{i}:é " for i in range(12)]
LONG = [f"w{i} " for i in range(80)]
CHAT = "/v1/chat/completions"


class Tenants:
    """A tenants file with `alpha` (no limits) and `beta` (one live run at a time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        alpha, alpha_entry = create_key(path, "alpha")
        beta, beta_entry = create_key(path, "beta")
        doc = tomlkit.parse(path.read_text())
        doc["tenants"]["beta"]["max_concurrent"] = 1
        path.write_text(tomlkit.dumps(doc))
        self.alpha = {"Authorization": f"Bearer {alpha}"}
        self.beta = {"Authorization": f"Bearer {beta}"}
        self.alpha_id, self.beta_id = alpha_entry.id, beta_entry.id


@pytest.fixture
def tenants(tmp_path) -> Tenants:
    return Tenants(tmp_path / "tenants.toml")


def script(request) -> list:
    """What the upstream does is chosen by the last message: `long`, `stall`, `fail`, or a short
    answer by default."""
    say = request.messages[-1].content
    if say == "long":
        return [s for p in LONG for s in (0.02, TextDelta(p))] + [Finish("stop"), Usage(7, 80)]
    if say == "stall":  # then silence, past the inter-token deadline
        return [0.01, TextDelta("a"), 0.01, TextDelta("b "), 0.01, TextDelta("c"), 5.0]
    if say == "fail":
        return [
            *(0.01, TextDelta("x"), 0.01, [TextDelta("y"), TextDelta("z")], 0.01),
            [TextDelta("w"), ErrorEvent("upstream_error", "The model failed.")],
            TextDelta("never"),
        ]
    steps: list = [s for p in PIECES for s in (0.01, TextDelta(p))]
    return [*steps, Finish("stop"), Usage(5, len(PIECES))]


class CountingAdapter(ScriptedAdapter):
    """Counts the tokens the scripted upstream yields per run, and what its abort reports."""

    def __init__(self) -> None:
        super().__init__("scripted", script)
        self.produced: dict[str, int] = {}
        self.reported: dict[str, int] = {}

    async def stream(self, request, request_id):
        self.produced[request_id] = 0
        async with aclosing(super().stream(request, request_id)) as events:
            async for batch in events:
                for event in batch:
                    if type(event) is TextDelta:
                        self.produced[request_id] += event.tokens
                    elif type(event) is Aborted:
                        self.reported[request_id] = event.completion_tokens
                yield batch


async def make_client(aiohttp_client, store_settings, tenants: Tenants, tmp_path, **settings):
    adapter = CountingAdapter()
    config = Settings(
        tenants=str(tenants.path),
        api_key=[],
        usage_file=str(tmp_path / "usage.jsonl"),
        **store_settings,
        **settings,
    )
    return adapter, await aiohttp_client(create_app(config, adapters=[adapter]))


def body(say: str = "hi", **extra) -> dict:
    return chat_body(messages=[{"role": "user", "content": say}], **extra)


def keyed(headers: dict, key: str) -> dict:
    return {**headers, "Idempotency-Key": key}


async def ledger_records(store_settings, tmp_path, count: int) -> list[UsageRecord]:
    """The ledger once it holds `count` records (settlement follows the run's end)."""

    async def enough() -> list[UsageRecord] | None:
        if store_settings:
            redis = Redis.from_url(REDIS_URL)
            try:
                ledger = RedisLedger(redis, prefix=store_settings["redis_prefix"])
                records = [r async for r in ledger.read()]
            finally:
                await redis.aclose()
        else:
            records = [r async for r in JsonlLedger(tmp_path / "usage.jsonl").read()]
        return records if len(records) >= count else None

    return await until(enough, f"{count} usage records")


async def replays_metric(client) -> float:
    text = await (await client.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_idempotent_replays":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("sluice_idempotent_replays_total is not exported")


def frames(raw: bytes) -> list[tuple[str | None, str]]:
    return [(e.id, e.data) for e in sse_events(raw)]


# -- replays -------------------------------------------------------------------------------------


async def test_a_finished_stream_replays_byte_for_byte(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    headers = keyed(tenants.alpha, "stream-1")
    first = await client.post(CHAT, json=body(stream=True), headers=headers)
    assert first.status == 200
    assert "idempotent-replayed" not in first.headers
    original = await first.read()
    again = await client.post(CHAT, json=body(stream=True), headers=headers)
    assert again.status == 200
    assert again.headers["idempotent-replayed"] == "true"
    replayed = await again.read()
    assert frames(replayed) == frames(original)  # same event ids, same payloads
    assert replayed == original
    assert stream_text([e.json() for e in sse_events(original)[:-1]]) == "".join(PIECES)
    assert len(adapter.requests) == 1


async def test_a_non_stream_retry_gets_the_same_object(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    headers = keyed(tenants.alpha, "plain-1")
    first = await client.post(CHAT, json=body(), headers=headers)
    assert first.status == 200
    assert "idempotent-replayed" not in first.headers
    again = await client.post(CHAT, json=body(), headers=headers)
    assert again.status == 200
    assert again.headers["idempotent-replayed"] == "true"
    original, replayed = await first.json(), await again.json()
    assert replayed == original
    assert replayed["id"].startswith("chatcmpl-")
    assert replayed["choices"][0]["message"]["content"] == "".join(PIECES)
    assert len(adapter.requests) == 1


async def test_a_retry_while_the_stream_is_live_attaches_to_it(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    headers = keyed(tenants.alpha, "live-1")
    first = await client.post(CHAT, json=body("long", stream=True), headers=headers)
    head = await first.content.readuntil(b"\n\n")
    run_id = sse_events(head)[0].json()["id"]
    live = await (await client.get(f"{CHAT}/{run_id}", headers=tenants.alpha)).json()
    assert live["status"] == "in_progress"
    again = await client.post(CHAT, json=body("long", stream=True), headers=headers)
    assert again.status == 200
    assert again.headers["idempotent-replayed"] == "true"
    original, replayed = head + await first.read(), await again.read()
    assert frames(replayed) == frames(original)
    assert stream_text([e.json() for e in sse_events(replayed)[:-1]]) == "".join(LONG)
    assert len(adapter.requests) == 1


async def test_the_same_key_with_another_body_is_a_422(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    headers = keyed(tenants.alpha, "reused-1")
    assert (await client.post(CHAT, json=body(), headers=headers)).status == 200
    resp = await client.post(CHAT, json=body("something else"), headers=headers)
    assert resp.status == 422
    assert resp.headers["x-should-retry"] == "false"
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key")
    assert len(adapter.requests) == 1


async def test_racing_identical_requests_make_one_run(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    headers = keyed(tenants.alpha, "race-1")

    async def one() -> tuple[bool, bytes]:
        resp = await client.post(CHAT, json=body(stream=True), headers=headers)
        assert resp.status == 200
        return resp.headers.get("idempotent-replayed") == "true", await resp.read()

    answers = await asyncio.gather(*(one() for _ in range(20)))
    assert len(adapter.requests) == 1
    assert sorted(replayed for replayed, _ in answers) == [False] + [True] * 19
    streams = [frames(raw) for _, raw in answers]
    assert all(s == streams[0] for s in streams)
    ids = {e.json()["id"] for _, raw in answers for e in sse_events(raw)[:-1]}
    assert len(ids) == 1
    assert stream_text([e.json() for e in sse_events(answers[0][1])[:-1]]) == "".join(PIECES)
    assert await replays_metric(client) == 19


async def test_a_key_belongs_to_its_tenant(aiohttp_client, store_settings, tenants, tmp_path):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    a = await client.post(CHAT, json=body(), headers=keyed(tenants.alpha, "shared-1"))
    b = await client.post(CHAT, json=body(), headers=keyed(tenants.beta, "shared-1"))
    assert (a.status, b.status) == (200, 200)
    assert "idempotent-replayed" not in b.headers
    assert (await a.json())["id"] != (await b.json())["id"]
    # beta's claim is its own: another body under it is refused, alpha's still replays
    c = await client.post(CHAT, json=body("other"), headers=keyed(tenants.beta, "shared-1"))
    assert c.status == 422
    d = await client.post(CHAT, json=body(), headers=keyed(tenants.alpha, "shared-1"))
    assert d.headers["idempotent-replayed"] == "true"
    assert (await d.json())["id"] == (await a.json())["id"]
    assert len(adapter.requests) == 2


@pytest.mark.parametrize("value", ["", "k" * 256, "bad\tkey", "caf\u00e9"])
async def test_a_malformed_key_is_a_400_naming_the_header(
    aiohttp_client, store_settings, tenants, tmp_path, value
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    resp = await client.post(CHAT, json=body(), headers=keyed(tenants.alpha, value))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "Idempotency-Key"
    assert "Idempotency-Key" in error["message"]
    assert adapter.requests == []


async def test_a_request_refused_by_its_quota_does_not_hold_the_key(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, tenants, tmp_path)
    busy = await client.post(CHAT, json=body("long", stream=True), headers=tenants.beta)
    busy_id = sse_events(await busy.content.readuntil(b"\n\n"))[0].json()["id"]
    headers = keyed(tenants.beta, "quota-1")
    refused = await client.post(CHAT, json=body(), headers=headers)
    assert refused.status == 429
    assert (await refused.json())["error"]["code"] == "rate_limit_exceeded"
    await client.post(f"{CHAT}/{busy_id}/cancel", headers=tenants.beta)
    busy.close()
    await ledger_records(store_settings, tmp_path, 1)  # settled: the live slot is free again
    retried = await client.post(CHAT, json=body(), headers=headers)
    assert retried.status == 200
    assert "idempotent-replayed" not in retried.headers
    assert (await retried.json())["choices"][0]["message"]["content"] == "".join(PIECES)
    assert len(adapter.requests) == 2


# -- the ledger ----------------------------------------------------------------------------------


async def test_one_ledger_record_per_run_however_it_ends(
    aiohttp_client, store_settings, tenants, tmp_path
):
    adapter, client = await make_client(
        aiohttp_client, store_settings, tenants, tmp_path, inter_token_timeout=0.3
    )
    headers = tenants.alpha
    ids: dict[str, str] = {}

    done = await client.post(CHAT, json=body(stream=True), headers=keyed(headers, "ledger-1"))
    ids["completed"] = sse_events(await done.read())[0].json()["id"]
    replay = await client.post(CHAT, json=body(stream=True), headers=keyed(headers, "ledger-1"))
    assert replay.headers["idempotent-replayed"] == "true"
    await replay.read()

    live = await client.post(CHAT, json=body("long", stream=True), headers=headers)
    head = b"".join([await live.content.readuntil(b"\n\n") for _ in range(5)])
    ids["cancelled"] = sse_events(head)[0].json()["id"]
    cancel = await client.post(f"{CHAT}/{ids['cancelled']}/cancel", headers=headers)
    assert (await cancel.json())["status"] == "cancelled"
    assert sse_events(await live.read())[-2].json()["error"]["code"] == "cancelled"

    stalled = sse_events(
        await (await client.post(CHAT, json=body("stall", stream=True), headers=headers)).read()
    )
    ids["timed_out"] = stalled[0].json()["id"]
    assert stalled[-2].json()["error"]["code"] == "timeout"

    failed = sse_events(
        await (await client.post(CHAT, json=body("fail", stream=True), headers=headers)).read()
    )
    ids["failed"] = failed[0].json()["id"]
    assert "error" in failed[-2].json()

    records = await ledger_records(store_settings, tmp_path, 4)
    # every run has settled, so nothing more can come: the replay added no record
    await until(lambda: not client.app[RUNS].drivers, "every run to settle")
    records = await ledger_records(store_settings, tmp_path, 4)
    assert sorted(r.run_id for r in records) == sorted(ids.values())
    by_status = {r.status: r for r in records}
    assert set(by_status) == {"completed", "cancelled", "timed_out", "failed"}
    for status, run_id in ids.items():
        record = by_status[status]
        assert record.run_id == run_id
        assert (record.tenant, record.principal, record.model) == (
            "alpha",
            tenants.alpha_id,
            "scripted",
        )
        assert record.principal.startswith("key_")
        assert record.generated_tokens == adapter.produced[run_id], status
    assert by_status["completed"].generated_tokens == len(PIECES)
    assert by_status["completed"].prompt_tokens == 5
    assert by_status["completed"].finish_reason == "stop"
    cancelled = by_status["cancelled"]
    assert cancelled.cancel_source == "client"
    assert cancelled.generated_tokens == cancelled.sent_tokens + cancelled.tail_tokens
    assert cancelled.generated_tokens == adapter.reported[ids["cancelled"]]
    assert 4 <= cancelled.generated_tokens < len(LONG)
    assert by_status["timed_out"].generated_tokens == 3
    assert by_status["timed_out"].cancel_source == "timeout"
    assert by_status["failed"].generated_tokens == 4
