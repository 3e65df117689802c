"""Flow control through the real app over a scripted upstream of fixed capacity (design §12):
runs beyond capacity wait `queued` in fair order, and a queued run is a run: retrievable,
cancellable, resumable, bound by its queue deadline, cancelled when its client leaves for good;
full queues shed `flex` first; `service_tier` is checked and echoed. Every test runs on the
in-process store and on a real Redis."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import orjson
import pytest

from adapters.events import TextDelta
from gateway.app_keys import AUTH as AUTH_KEY
from gateway.app_keys import FLOWS, LEDGER, METRICS, RUNS
from policies.tenants import Tenant, TenantLimits, single_tenant
from policies.tenants_sharing import Sharing
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events, stream_payloads
from tests.support.waiting import until

HOLD = 30.0  # a pause no test waits out: the run holds its slot until it is cancelled


def held(request) -> list:
    """One token, then hold the slot (the first request's script)."""
    return [TextDelta("held "), HOLD, TextDelta("never")]


def quick(request) -> list:
    return text_script(["a", "b"])(request)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def add_tenant(app, name: str, **sharing) -> dict[str, str]:
    """Give the app a tenant with these sharing fields; its auth headers."""
    auth = app[AUTH_KEY]
    key = f"sk-sluice-{name}-key"
    keys = single_tenant([key], name).tenants[name].keys
    tenant = Tenant(name, keys=keys, sharing=Sharing(**sharing))
    auth.reload(replace(auth.config, tenants={**auth.config.tenants, name: tenant}))
    app[METRICS].know_tenants([tenant])
    return bearer(key)


async def make_client(
    aiohttp_client, store_settings, capacity: int | None = 1, hold: bool = True, **settings
):
    first = hold

    def script(request) -> list:  # the first run holds its slot (with `hold`); others are quick
        nonlocal first
        steps, first = (held if first else quick)(request), False
        return steps

    adapter = ScriptedAdapter("scripted", script, capacity=capacity)
    app = gateway_app(adapters=[adapter], **store_settings, **settings)
    return adapter, await aiohttp_client(app)


async def submit(client, headers=AUTH, **body) -> asyncio.Task:
    """A non-streaming request in the background."""
    return asyncio.create_task(
        client.post("/v1/chat/completions", json=chat_body(**body), headers=headers)
    )


async def retrieve(client, run_id: str, headers=AUTH) -> dict:
    return await (await client.get(f"/v1/chat/completions/{run_id}", headers=headers)).json()


def queued_ids(client) -> list[str]:
    return [d.run_id for d in client.app[RUNS].drivers.values() if d.phase.name == "WAITING"]


async def hold_the_slot(client, adapter) -> str:
    """Start the run that holds the only slot; its id once it streams."""
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    first = orjson.loads(sse_events(await resp.content.readuntil(b"\n\n"))[0].data)
    await until(lambda: adapter.requests, "the first run to reach the upstream")
    return first["id"]


async def test_runs_past_capacity_wait_and_go_in_fair_order(aiohttp_client, store_settings):
    adapter, client = await make_client(aiohttp_client, store_settings)
    quiet = add_tenant(client.app, "quiet")
    holder = await hold_the_slot(client, adapter)
    noisy = [await submit(client) for _ in range(3)]
    await until(lambda: len(queued_ids(client)) == 3, "three runs to queue")
    for run_id in queued_ids(client):
        assert (await retrieve(client, run_id))["status"] == "queued"
    late = await submit(client, headers=quiet)
    await until(lambda: len(queued_ids(client)) == 4, "the quiet run to queue")
    await client.post(f"/v1/chat/completions/{holder}/cancel", headers=AUTH)
    for task in (*noisy, late):
        assert (await task).status == 200
    # the quiet tenant's run arrived last and went first: the noisy tenant had a run going
    digests = [r.share.tenant for r in adapter.requests]
    quiet_digest = client.app[AUTH_KEY].tenant("quiet").digest
    assert digests.index(quiet_digest) == 1
    assert client.app[FLOWS].of(adapter).in_flight == 0


async def test_a_queued_run_can_be_cancelled_and_never_reaches_the_upstream(
    aiohttp_client, store_settings
):
    adapter, client = await make_client(aiohttp_client, store_settings)
    await hold_the_slot(client, adapter)
    waiting = await submit(client)
    await until(lambda: queued_ids(client), "the run to queue")
    (run_id,) = queued_ids(client)
    cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    assert (await cancel.json())["status"] == "cancelled"
    resp = await waiting
    assert resp.status == 499 and (await resp.json())["error"]["code"] == "cancelled"
    assert len(adapter.requests) == 1
    flow = client.app[FLOWS].of(adapter)
    assert (len(flow.queue), flow.in_flight) == (0, 1)  # only the holder
    metrics = await (await client.get("/metrics")).text()
    assert 'sluice_flow_queue_depth{tenant="default",tier="default"} 0.0' in metrics


async def test_a_queued_run_ends_at_its_queue_deadline(aiohttp_client, store_settings):
    adapter, client = await make_client(aiohttp_client, store_settings, queue_timeout=0.2)
    await hold_the_slot(client, adapter)
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "timeout"
    assert len(adapter.requests) == 1

    async def counted() -> bool:
        metrics = await (await client.get("/metrics")).text()
        return 'sluice_deadlines_exceeded_total{deadline="queue"} 1.0' in metrics

    await until(counted, "the queue deadline to be counted")


async def test_a_client_that_leaves_a_queued_stream_for_good_cancels_it(
    aiohttp_client, store_settings
):
    adapter, client = await make_client(
        aiohttp_client, store_settings, disconnect_grace=0.1, ping_interval=0.05
    )
    await hold_the_slot(client, adapter)
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    assert resp.status == 200  # headers after one ping interval: the run is queued
    (run_id,) = queued_ids(client)
    resp.close()

    async def ended() -> dict | None:
        body = await retrieve(client, run_id)
        return body if body["status"] != "queued" else None

    body = await until(ended, "the grace window to end the queued run")
    assert (body["status"], body["error"]["code"]) == ("cancelled", "cancelled")
    assert len(adapter.requests) == 1


async def test_a_queued_stream_resumes_and_follows_the_run_once_it_goes(
    aiohttp_client, store_settings
):
    adapter, client = await make_client(
        aiohttp_client, store_settings, disconnect_grace=5, ping_interval=0.05
    )
    holder = await hold_the_slot(client, adapter)
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    await until(lambda: queued_ids(client), "the run to queue")
    (run_id,) = queued_ids(client)
    resp.close()
    await until(lambda: client.app[RUNS].in_grace(run_id), "the client's leaving to be noticed")
    resumed = asyncio.create_task(
        client.get(f"/v1/chat/completions/{run_id}", params={"stream": "true"}, headers=AUTH)
    )
    await until(lambda: not client.app[RUNS].in_grace(run_id), "the resume to follow the run")
    await client.post(f"/v1/chat/completions/{holder}/cancel", headers=AUTH)
    payloads = stream_payloads(await (await resumed).read())
    text = "".join(
        c["delta"].get("content") or "" for p in payloads[:-1] if p["choices"] for c in p["choices"]
    )
    assert (text, payloads[-1]) == ("ab", "[DONE]")


@pytest.mark.parametrize("tier", ["default", "priority"])
async def test_a_full_queue_sheds_its_newest_flex_run_for_a_higher_tier(
    aiohttp_client, store_settings, tier
):
    adapter, client = await make_client(aiohttp_client, store_settings)
    batch = add_tenant(client.app, "batch", tiers=("default", "flex", "priority"), max_queued=2)
    await hold_the_slot(client, adapter)
    older = await submit(client, headers=batch, service_tier="flex")
    await until(lambda: len(queued_ids(client)) == 1, "the first flex run to queue")
    newer = await submit(client, headers=batch, service_tier="flex")
    await until(lambda: len(queued_ids(client)) == 2, "the second flex run to queue")
    wanted = await submit(client, headers=batch, service_tier=tier)
    shed = await newer
    assert shed.status == 429
    assert (await shed.json())["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(shed.headers["retry-after"]) <= 60
    await until(lambda: len(queued_ids(client)) == 2, f"the {tier} run to queue")
    # a flex run finds no room, and neither does a default one once no flex run is left to shed
    refused = await client.post(
        "/v1/chat/completions", json=chat_body(service_tier="flex"), headers=batch
    )
    assert refused.status == 429
    metrics = await (await client.get("/metrics")).text()
    assert 'sluice_flow_shed_total{tier="flex"} 2.0' in metrics
    for task in (older, wanted):
        assert not task.done()
        task.cancel()


async def test_a_default_run_is_refused_only_when_no_flex_run_can_give_way(
    aiohttp_client, store_settings
):
    adapter, client = await make_client(aiohttp_client, store_settings)
    small = add_tenant(client.app, "small", max_queued=1)
    await hold_the_slot(client, adapter)
    first = await submit(client, headers=small)
    await until(lambda: queued_ids(client), "the run to queue")
    refused = await client.post("/v1/chat/completions", json=chat_body(), headers=small)
    assert refused.status == 429
    body = await refused.json()
    assert (body["error"]["type"], body["error"]["code"]) == ("requests", "rate_limit_exceeded")
    assert "retry-after" in refused.headers
    metrics = await (await client.get("/metrics")).text()
    assert 'sluice_flow_shed_total{tier="default"} 1.0' in metrics
    first.cancel()


async def test_priority_goes_ahead_of_default_and_flex_waits_for_both(
    aiohttp_client, store_settings
):
    adapter, client = await make_client(aiohttp_client, store_settings)
    vip = add_tenant(client.app, "vip", tiers=("default", "priority", "flex"))
    holder = await hold_the_slot(client, adapter)
    tasks = []
    for n, tier in enumerate(("flex", "default", "priority"), 1):
        tasks.append(await submit(client, headers=vip, service_tier=tier))
        await until(lambda n=n: len(queued_ids(client)) == n, f"the {tier} run to queue")
    await client.post(f"/v1/chat/completions/{holder}/cancel", headers=AUTH)
    answers = [await (await task).json() for task in tasks]
    assert [a["service_tier"] for a in answers] == ["flex", "default", "priority"]
    assert [r.share.tier for r in adapter.requests[1:]] == ["priority", "default", "flex"]


async def test_service_tier_is_checked_against_the_tenants_tiers_and_echoed(
    aiohttp_client, store_settings
):
    _, client = await make_client(aiohttp_client, store_settings, capacity=8, hold=False)
    plain = add_tenant(client.app, "plain", tiers=("default",))
    refused = await client.post(
        "/v1/chat/completions", json=chat_body(service_tier="priority"), headers=plain
    )
    assert refused.status == 400
    error = (await refused.json())["error"]
    assert (error["param"], error["code"]) == ("service_tier", "service_tier_not_allowed")
    bad = await client.post(
        "/v1/chat/completions", json=chat_body(service_tier="gold"), headers=plain
    )
    assert (await bad.json())["error"]["param"] == "service_tier"
    resp = await client.post(
        "/v1/chat/completions", json=chat_body(stream=True, service_tier="auto"), headers=plain
    )
    chunks = [p for p in stream_payloads(await resp.read()) if p != "[DONE]"]
    assert {c["service_tier"] for c in chunks} == {"default"}
    run_id = chunks[0]["id"]
    assert (await retrieve(client, run_id, plain))["service_tier"] == "default"
    assert not queued_ids(client)  # capacity to spare: nothing waited


async def test_without_a_bound_every_run_goes_at_once(aiohttp_client, store_settings):
    adapter, client = await make_client(aiohttp_client, store_settings, capacity=None)
    holder = await hold_the_slot(client, adapter)
    answers = await asyncio.gather(*[await submit(client) for _ in range(3)])
    assert [a.status for a in answers] == [200, 200, 200]
    await client.post(f"/v1/chat/completions/{holder}/cancel", headers=AUTH)
    metrics = await (await client.get("/metrics")).text()
    assert 'sluice_tenant_tokens_served_total{tenant="default"} 7.0' in metrics


async def test_a_queued_run_that_ends_gives_back_its_concurrency_slot_and_leaves_one_record(
    aiohttp_client, store_settings, tmp_path
):
    adapter, client = await make_client(
        aiohttp_client, store_settings, usage_file=str(tmp_path / "usage.jsonl"), ping_interval=0.05
    )
    auth = client.app[AUTH_KEY]
    key = "sk-sluice-capped-key"
    capped = Tenant(
        "capped",
        limits=TenantLimits(max_concurrent=2),
        keys=single_tenant([key], "capped").tenants["capped"].keys,
    )
    auth.reload(replace(auth.config, tenants={**auth.config.tenants, "capped": capped}))
    await hold_the_slot(client, adapter)
    queued = await submit(client, headers=bearer(key))
    await until(lambda: queued_ids(client), "the capped tenant's run to queue")
    (run_id,) = queued_ids(client)
    other = await submit(client, headers=bearer(key))
    await until(lambda: len(queued_ids(client)) == 2, "its second run to queue")
    full = await client.post("/v1/chat/completions", json=chat_body(), headers=bearer(key))
    assert full.status == 429  # two live runs, queued ones included: its concurrency limit
    assert (await full.json())["error"]["code"] == "rate_limit_exceeded"
    await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=bearer(key))
    assert (await queued).status == 499

    async def records() -> list:
        return [r async for r in client.app[LEDGER].read(tenant="capped") if r.run_id == run_id]

    (record,) = await until(records, "the cancelled run's usage record")
    assert (record.status, record.generated_tokens) == ("cancelled", 0)

    async def admitted() -> bool:  # the cancelled run's slot comes back as it settles
        resp = await client.post(
            "/v1/chat/completions", json=chat_body(stream=True), headers=bearer(key)
        )
        resp.close()  # queued: its headers come within a heartbeat; it is cancelled after
        return resp.status == 200

    await until(admitted, "a new run to take the cancelled run's slot")
    other.cancel()
