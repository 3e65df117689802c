"""The real worker process (`python -m workers.cli`) on the tiny model, over HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.metric_names import WORKER_METRICS
from tests.support.waiting import until
from tests.support.worker_process import Worker, running_worker

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    with running_worker(
        tiny_model_dir, tmp_path_factory.mktemp("worker"), "--max-num-seqs", "1"
    ) as w:
        yield w


def body(request_id: str, **overrides) -> dict:
    """ignore_eos: a sampled run on the tiny model may draw EOS; these runs must stay long."""
    return {
        "request_id": request_id,
        "messages": HI,
        "max_tokens": 8,
        "ignore_eos": True,
        **overrides,
    }


async def stats(session: aiohttp.ClientSession, worker: Worker) -> dict:
    async with session.get(worker.url + "/v1/stats") as response:
        return await response.json()


async def generated_tokens(session: aiohttp.ClientSession, worker: Worker) -> float:
    async with session.get(worker.url + "/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["sluice_worker_generated_tokens"].samples[0].value


async def stats_now(session: aiohttp.ClientSession, worker: Worker, field: str, value) -> bool:
    return (await stats(session, worker))[field] == value


async def wait_idle(session: aiohttp.ClientSession, worker: Worker) -> dict:
    async def idle() -> dict | None:
        current = await stats(session, worker)
        return None if current["running"] or current["waiting"] else current

    return await until(idle, "the worker to go idle")


def log_events(worker: Worker) -> list[dict]:
    lines = worker.log.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


async def test_ready_is_logged_with_the_port(worker: Worker) -> None:
    [ready] = [e for e in log_events(worker) if e["event"] == "worker ready"]
    assert ready["port"] == worker.port
    async with aiohttp.ClientSession() as session, session.get(worker.url + "/health") as response:
        assert (response.status, await response.json()) == (200, {"status": "ok"})


async def test_generate_streams_ndjson(worker: Worker) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(worker.url + "/v1/generate", json=body("s1", temperature=0)) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/x-ndjson"
        lines = [orjson.loads(line) async for line in response.content]
    assert lines[0] == {"type": "start", "prompt_tokens": 17}
    assert lines[1] == {"type": "admitted"}
    assert {line["type"] for line in lines[2:-2]} == {"text"}
    assert lines[-2] == {"type": "finish", "index": 0, "reason": "length", "completion_tokens": 8}
    assert lines[-1] == {"type": "usage", "prompt_tokens": 17, "completion_tokens": 8}


async def test_validation_400_names_max_tokens(worker: Worker) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(worker.url + "/v1/generate", json=body("v1", max_tokens=5000)) as response,
    ):
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["param"] == "max_tokens"
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"


async def test_abort_by_post(worker: Worker) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(worker.url + "/v1/generate", json=body("a1", max_tokens=1000)) as r:
            assert orjson.loads(await r.content.readline())["type"] == "start"
            assert orjson.loads(await r.content.readline())["type"] == "admitted"
            assert orjson.loads(await r.content.readline())["type"] == "text"
            async with session.post(worker.url + "/v1/abort", json={"request_id": "a1"}) as a:
                assert await a.json() == {"aborted": True}
            lines = [orjson.loads(line) async for line in r.content]
        assert lines[-2]["type"] == "finish" and lines[-2]["reason"] == "abort"
        assert lines[-2]["completion_tokens"] < 1000
        assert (await wait_idle(session, worker))["running"] == 0


async def test_abort_by_closing_the_connection(worker: Worker) -> None:
    async with aiohttp.ClientSession() as session:
        before = await generated_tokens(session, worker)
        response = await session.post(worker.url + "/v1/generate", json=body("c1", max_tokens=1000))
        await response.content.readline()
        await response.content.readline()
        response.close()
        current = await wait_idle(session, worker)
        assert (current["running"], current["waiting"]) == (0, 0)
        assert await generated_tokens(session, worker) - before < 200


async def test_closing_a_waiting_request_aborts_it_before_it_runs(worker: Worker) -> None:
    """With --max-num-seqs 1 the second request waits; its disconnect is noticed all the same."""
    url = worker.url + "/v1/generate"
    async with aiohttp.ClientSession() as session:
        before = await generated_tokens(session, worker)
        async with session.post(url, json=body("w1", max_tokens=1000)) as first:
            assert orjson.loads(await first.content.readline())["type"] == "start"
            assert orjson.loads(await first.content.readline())["type"] == "admitted"  # running
            second = await session.post(url, json=body("w2", max_tokens=1000))
            assert orjson.loads(await second.content.readline())["type"] == "start"
            assert (await stats(session, worker))["waiting"] == 1  # queued: no `admitted` yet
            second.close()  # the worker notices at once and drops it from its queue
            await until(
                lambda: stats_now(session, worker, "waiting", 0), "the queued request to go"
            )
            async with session.post(worker.url + "/v1/abort", json={"request_id": "w1"}):
                pass
            lines = [orjson.loads(line) async for line in first.content]
        await wait_idle(session, worker)
        assert lines[-2]["reason"] == "abort"
        # every token generated belongs to the first request: the second never ran
        assert await generated_tokens(session, worker) - before == lines[-2]["completion_tokens"]


async def test_metrics_parse(worker: Worker) -> None:
    async with aiohttp.ClientSession() as session, session.get(worker.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names >= WORKER_METRICS


async def test_sigterm_ends_live_streams_and_exits_cleanly(worker: Worker) -> None:
    """Runs last: it stops the module's worker."""
    async with aiohttp.ClientSession() as session:
        response = await session.post(worker.url + "/v1/generate", json=body("t1", max_tokens=1000))
        await response.content.readline()
        worker.proc.send_signal(signal.SIGTERM)
        lines = [orjson.loads(line) async for line in response.content]
        response.close()
    assert lines[-1] == {
        "type": "error",
        "code": "shutting_down",
        "message": "the worker is shutting down",
    }
    assert await asyncio.to_thread(worker.proc.wait, 15) == 0
    assert [e["event"] for e in log_events(worker)][-1] == "worker stopping"
