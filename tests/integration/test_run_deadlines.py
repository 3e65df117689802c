"""Deadlines against a real worker process (one sequence at a time, so a second request waits in
its queue): each fires with its own cause, the worker stops, and nothing is left behind in it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from adapters.worker_client import WorkerAdapter
from gateway.app_keys import RUNS
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events
from tests.support.waiting import until
from tests.support.worker_process import Worker, running_worker


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log_dir = tmp_path_factory.mktemp("deadlines-worker")
    with running_worker(tiny_model_dir, log_dir, "--max-num-seqs", "1") as started:
        yield started


async def make_gateway(aiohttp_client, worker: Worker, **deadlines):
    model = (await _json(f"{worker.url}/v1/model"))["id"]
    app = gateway_app(adapters=[WorkerAdapter(worker.url)], **deadlines)
    return model, await aiohttp_client(app)


async def _json(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.json()


async def assert_worker_idle(worker: Worker) -> None:
    """Nothing running or waiting and every KV block back, within a generous bound."""

    async def idle() -> bool:
        stats = await _json(f"{worker.url}/v1/stats")
        return (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)

    await until(idle, "the worker to hold nothing")


settings_flag = {"deadline:queue": "--queue-timeout", "deadline:ttft": "--ttft-timeout"}


def long_request(model: str, **extra) -> dict:
    return chat_body(model, max_tokens=900, temperature=0, **extra)


async def cause_of(client, run_id: str) -> str:
    return (await client.app[RUNS].get(run_id)).terminal.cause


async def deadline_metric(client, deadline: str) -> bool:
    """Counted once the run is settled (after the worker confirmed its stop)."""
    line = f'sluice_deadlines_exceeded_total{{deadline="{deadline}"}} 1.0'

    async def counted() -> bool:
        return line in await (await client.get("/metrics")).text()

    return await until(counted, f"the {deadline} deadline to be counted")


@pytest.mark.parametrize(
    ("settings", "cause"),
    [
        ({"queue_timeout": 0.3}, "deadline:queue"),
        ({"queue_timeout": 0, "ttft_timeout": 0.3}, "deadline:ttft"),
    ],
)
async def test_a_run_stuck_behind_another_times_out_before_admission(
    aiohttp_client, worker, settings, cause
):
    model, client = await make_gateway(aiohttp_client, worker, **settings)
    blocker = await client.post(
        "/v1/chat/completions", json=long_request(model, stream=True), headers=AUTH
    )
    blocker_id = sse_events(await blocker.content.readuntil(b"\n\n"))[0].json()["id"]
    waiting = await client.post("/v1/chat/completions", json=long_request(model), headers=AUTH)
    assert waiting.status == 504
    error = (await waiting.json())["error"]
    assert error["code"] == "timeout"
    assert settings_flag[cause] in error["message"]
    assert await deadline_metric(client, cause.removeprefix("deadline:"))
    await client.post(f"/v1/chat/completions/{blocker_id}/cancel", headers=AUTH)
    blocker.close()
    await assert_worker_idle(worker)


@pytest.mark.parametrize(
    ("settings", "cause"),
    [
        ({"inter_token_timeout": 0.001}, "deadline:inter_token"),
        ({"total_timeout": 0.3}, "deadline:total"),
    ],
)
async def test_a_streaming_run_past_its_deadline_ends_with_a_timeout_frame(
    aiohttp_client, worker, settings, cause
):
    model, client = await make_gateway(aiohttp_client, worker, **settings)
    resp = await client.post(
        "/v1/chat/completions", json=long_request(model, stream=True), headers=AUTH
    )
    events = sse_events(await resp.read())
    run_id = events[0].json()["id"]
    assert events[-2].json()["error"]["code"] == "timeout"
    assert events[-1].data == "[DONE]"
    assert await cause_of(client, run_id) == cause
    retrieved = await (await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)).json()
    assert retrieved["status"] == "timed_out"
    await assert_worker_idle(worker)
    assert await deadline_metric(client, cause.removeprefix("deadline:"))
