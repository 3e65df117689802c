"""A local worker's death is an event (design §11): its pool and the gateway's readiness drop it
the moment its supervisor sees the process exit, only a probe of the new process brings it
back, and a request that finds its model's only worker restarting waits for it, `queued`,
unless it asked not to wait (`x-sluice-no-wait: true`). A member that crash loops is not
waited for. Fake members and a scripted upstream; the real processes are in
tests/e2e/test_worker_restart.py."""

from __future__ import annotations

import asyncio

import pytest

from adapters.base import BackendUnavailable
from adapters.pool import PoolAdapter
from gateway.app_keys import FLOWS, HEALTH, RUNS
from gateway.backends.health import BackendHealth
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, stream_payloads, stream_text
from tests.support.waiting import until
from tests.unit.test_flow_control import queued_ids
from tests.unit.test_pool import Member, chat, run

WORKER = "local:1"


def local_pool(*members, looping: set[str] | None = None) -> PoolAdapter:
    """A pool of local workers whose supervisor says `looping` crash loop."""
    crash_looping = (looping or set()).__contains__
    return PoolAdapter(list(members), f"pool:{members[0].name}", crash_looping=crash_looping)


def waiting_for_a_member(pool: PoolAdapter) -> bool:
    """Whether a run is parked in the pool until a member comes back (its `_changed` event)."""
    return bool(pool._changed._waiters)


def exited(pool: PoolAdapter, health: BackendHealth | None, name: str = WORKER) -> None:
    """What the supervisor's exit listeners do, in their order: the pools, then readiness."""
    pool.member_exited(name)
    if health is not None:
        health.member_exited(name)


async def test_an_exit_takes_the_pool_out_of_readiness_at_once_until_a_probe_finds_it_serving():
    worker = Member(WORKER)
    pool = local_pool(worker)
    health = BackendHealth([pool])
    await health.probe()
    assert health.ready(pool) and health.restarting(pool) == []
    worker.up = False  # killed; nothing has probed it since
    exited(pool, health)
    assert health.ready(pool) is False  # no probe taken: the exit itself
    assert health.restarting(pool) == [WORKER]
    assert pool.capacity() == 0  # flow control queues runs rather than send them
    await health.probe()  # the new process is loading: its /health says 503
    assert health.ready(pool) is False and health.restarting(pool) == [WORKER]
    worker.up = True  # it serves
    await health.probe()
    assert health.ready(pool) is True and health.restarting(pool) == []


async def test_a_probe_answered_before_the_exit_does_not_bring_the_dead_process_back():
    worker = Member(WORKER)
    pool = local_pool(worker)
    health = BackendHealth([pool])
    await health.probe()
    answered, gate = asyncio.Event(), asyncio.Event()

    async def ready_then_dies() -> bool:
        answered.set()
        await gate.wait()
        return True  # what the old process said just before it was killed

    worker.ready = ready_then_dies  # type: ignore[method-assign]
    probing = asyncio.create_task(health.probe())
    await answered.wait()
    exited(pool, health)
    gate.set()
    await probing
    assert health.ready(pool) is False and health.restarting(pool) == [WORKER]


async def test_an_exit_of_one_member_leaves_its_pool_ready_on_the_other():
    worker, other = Member(WORKER), Member("local:2")
    pool = local_pool(worker, other)
    health = BackendHealth([pool])
    await health.probe()
    exited(pool, health)
    assert health.ready(pool) is True
    assert health.restarting(pool) == [WORKER]  # /readyz names it all the same


async def test_a_crash_looping_member_is_not_waited_for():
    worker = Member(WORKER)
    pool = local_pool(worker, looping={WORKER})
    health = BackendHealth([pool])
    await health.probe()
    exited(pool, health)
    assert health.ready(pool) is False and health.restarting(pool) == []
    with pytest.raises(BackendUnavailable):
        await run(pool, chat(), "r1")


async def test_a_restart_that_serves_is_probed_at_once_not_at_the_next_tick():
    worker = Member(WORKER)
    pool = local_pool(worker)
    health = BackendHealth([pool], interval=3600.0)
    await health.start()
    try:
        worker.up = False
        exited(pool, health)
        worker.up = True
        health.member_restarted(WORKER)  # the supervisor saw its /health say ready
        await until(lambda: health.ready(pool), "the restart to be probed")
    finally:
        await health.stop()


async def test_a_run_that_finds_its_only_member_restarting_waits_for_it():
    worker = Member(WORKER)
    pool = local_pool(worker)
    await pool.ready()
    worker.up = False
    exited(pool, None)
    waiting = asyncio.create_task(run(pool, chat(), "r1"))
    await until(lambda: waiting_for_a_member(pool), "the run to wait for a member")
    assert worker.served == []
    worker.up = True
    await pool.ready()
    assert await waiting == WORKER


# -- through the app: admission, the queued run, /readyz ---------------------------------------


async def restarting_gateway(aiohttp_client, **settings):
    """A gateway whose one model is served by a pool of one (scripted) local worker, which
    has just exited and is loading again."""
    worker = ScriptedAdapter("scripted", text_script(["back ", "again"]))
    pool = local_pool(worker)
    client = await aiohttp_client(gateway_app(adapters=[pool], **settings))
    worker.is_ready = False
    exited(pool, client.app[HEALTH], worker.name)
    return worker, client


async def test_readyz_is_503_and_names_the_worker_from_its_exit_until_it_serves(aiohttp_client):
    worker, client = await restarting_gateway(aiohttp_client)
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert await ready.json() == {
        "status": "unavailable",
        "models": {"scripted": False},
        "store": "in-process",
        "restarting": {"scripted": [worker.name]},
    }
    worker.is_ready = True
    await client.app[HEALTH].probe()
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert await ready.json() == {
        "status": "ready",
        "models": {"scripted": True},
        "store": "in-process",
    }


async def test_a_request_while_the_only_worker_restarts_waits_queued_and_is_served(
    aiohttp_client,
):
    worker, client = await restarting_gateway(aiohttp_client, ping_interval=0.05)
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    assert resp.status == 200  # headers within a ping interval: the run waits, queued
    (run_id,) = queued_ids(client)
    assert resp.headers["x-sluice-run-id"] == run_id
    got = await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)
    assert (await got.json())["status"] == "queued"
    plain = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(), headers=AUTH))
    await until(lambda: len(queued_ids(client)) == 2, "the second run to queue")
    assert worker.requests == []
    worker.is_ready = True
    await client.app[HEALTH].probe()
    payloads = stream_payloads(await resp.read())
    assert stream_text(payloads) == "back again" and payloads[-1] == "[DONE]"
    answer = await plain
    assert answer.status == 200
    assert (await answer.json())["choices"][0]["message"]["content"] == "back again"
    assert client.app[FLOWS].of(client.app[HEALTH].adapters[0]).in_flight == 0


async def test_a_run_waiting_for_a_restart_can_be_cancelled(aiohttp_client):
    worker, client = await restarting_gateway(aiohttp_client)
    waiting = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    )
    await until(lambda: queued_ids(client), "the run to queue")
    (run_id,) = queued_ids(client)
    cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    assert (await cancel.json())["status"] == "cancelled"
    resp = await waiting
    assert resp.status == 499 and (await resp.json())["error"]["code"] == "cancelled"
    assert worker.requests == []


async def test_a_run_waiting_for_a_restart_ends_at_its_queue_deadline(aiohttp_client):
    worker, client = await restarting_gateway(aiohttp_client, queue_timeout=0.2)
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    assert resp.status == 504 and (await resp.json())["error"]["code"] == "timeout"
    assert worker.requests == []


async def test_a_request_that_may_not_wait_is_refused_at_once_while_the_worker_restarts(
    aiohttp_client,
):
    worker, client = await restarting_gateway(aiohttp_client)
    no_wait = {**AUTH, "x-sluice-no-wait": "true"}
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=no_wait)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "overloaded"
    assert int(resp.headers["retry-after"]) >= 1
    bad = {**AUTH, "x-sluice-no-wait": "maybe"}
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=bad)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "x-sluice-no-wait"
    assert queued_ids(client) == [] and worker.requests == []


async def test_a_model_whose_worker_crash_loops_is_refused_at_once(aiohttp_client):
    worker = ScriptedAdapter("scripted", text_script(["x"]))
    pool = local_pool(worker, looping={worker.name})
    client = await aiohttp_client(gateway_app(adapters=[pool]))
    worker.is_ready = False
    exited(pool, client.app[HEALTH], worker.name)
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "overloaded"
    ready = await client.get("/readyz")
    assert ready.status == 503 and "restarting" not in await ready.json()


async def test_a_request_that_may_not_wait_is_refused_when_the_backend_is_saturated(
    aiohttp_client,
):
    worker = ScriptedAdapter("scripted", lambda request: [30.0], capacity=1)
    client = await aiohttp_client(gateway_app(adapters=[worker], ping_interval=0.05))
    holder = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    await until(lambda: worker.requests, "the first run to take the only slot")
    no_wait = {**AUTH, "x-sluice-no-wait": "true"}
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=no_wait)
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "overloaded"
    assert int(resp.headers["retry-after"]) >= 1
    assert queued_ids(client) == [] and len(client.app[FLOWS].of(worker).queue) == 0
    holder.close()


async def test_without_flow_control_the_run_waits_in_the_pool_for_the_restart(aiohttp_client):
    worker, client = await restarting_gateway(aiohttp_client, scheduling="fcfs")
    waiting = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    )
    pool = client.app[HEALTH].adapters[0]
    await until(lambda: waiting_for_a_member(pool), "the run to wait for its member")
    (driver,) = client.app[RUNS].drivers.values()
    got = await client.get(f"/v1/chat/completions/{driver.run_id}", headers=AUTH)
    assert (await got.json())["status"] == "queued"
    worker.is_ready = True
    await client.app[HEALTH].probe()
    resp = await waiting
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "back again"
