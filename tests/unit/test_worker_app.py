"""The worker app built from its factory: the worker API of docs/worker-api.md, route by route."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from tests.support.loops import WORKERS_LOOP
from tests.support.metric_names import WORKER_METRICS
from tests.support.waiting import until
from workers.app_keys import SERVICE
from workers.config import WorkerConfig
from workers.server import create_worker_app

EVENT_LOOP = WORKERS_LOOP  # the loop these tests run on

HI = [{"role": "user", "content": "Hi"}]


async def wait_healthy(client) -> None:
    async def healthy() -> bool:
        return (await client.get("/health")).status == 200

    await until(healthy, "the worker app to become healthy")


@pytest.fixture
async def client(aiohttp_client, loaded, tiny_model_dir):
    config = WorkerConfig(model=str(tiny_model_dir), device="cpu", dtype="float32")
    client = await aiohttp_client(create_worker_app(config, loaded=loaded))
    await wait_healthy(client)
    return client


def body(**overrides) -> dict:
    """ignore_eos: a sampled run on the tiny model may draw EOS; these runs must stay long."""
    return {"request_id": "req-1", "messages": HI, "max_tokens": 8, "ignore_eos": True, **overrides}


async def read_lines(response) -> list[dict]:
    return [orjson.loads(line) for line in (await response.read()).splitlines()]


async def stats(client) -> dict:
    return await (await client.get("/v1/stats")).json()


async def generated_tokens(client) -> float:
    text = await (await client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["sluice_worker_generated_tokens"].samples[0].value


async def wait_for_idle(client) -> dict:
    async def idle() -> dict | None:
        current = await stats(client)
        return None if current["running"] or current["waiting"] else current

    return await until(idle, "the worker to go idle")


async def test_health_and_model(client) -> None:
    response = await client.get("/health")
    assert (response.status, await response.json()) == (200, {"status": "ok"})
    response = await client.get("/v1/model")
    info = await response.json()
    assert abs(info.pop("created") - time.time()) < 600  # when it began serving the model
    assert info == {
        "id": "tiny",
        "max_model_len": 1024,
        "vocab_size": 600,
        "device": "cpu",
        "dtype": "float32",
        "api_version": 6,
        "max_body_bytes": (4 << 20) + (64 << 10) + (1 << 20),
        "max_num_seqs": 32,
    }


async def test_generate_streams_ndjson(client) -> None:
    steps_before = (await stats(client))["steps"]
    response = await client.post("/v1/generate", json=body(temperature=0, n=2))
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/x-ndjson"
    lines = await read_lines(response)
    assert lines[0] == {"type": "start", "prompt_tokens": 17}
    assert lines[1] == {"type": "admitted"}  # once, though two choices run
    assert [line["type"] for line in lines].count("admitted") == 1
    finishes = [line for line in lines if line["type"] == "finish"]
    assert sorted((f["index"], f["reason"], f["completion_tokens"]) for f in finishes) == [
        (0, "length", 8),
        (1, "length", 8),
    ]
    assert lines[-1] == {"type": "usage", "prompt_tokens": 17, "completion_tokens": 16}
    # the engine's step counter moved (a prefill and 7 more decode steps at least)
    assert (await stats(client))["steps"] >= steps_before + 8
    texts = {
        i: "".join(x["text"] for x in lines if x.get("index") == i and x["type"] == "text")
        for i in (0, 1)
    }
    assert texts[0] == texts[1] != ""  # greedy: both choices agree


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    [
        (body(max_tokens=1010), "max_tokens", "context_length_exceeded"),
        (
            body(messages=[{"role": "user", "content": "word " * 1100}]),
            "messages",
            "context_length_exceeded",
        ),
        (body(temperature=-1), "temperature", "invalid_value"),
        (body(stop_token_ids=[600]), "stop_token_ids", "invalid_value"),
        (body(messages="Hi"), "messages", "invalid_type"),
        ({"messages": HI}, "request_id", "invalid_type"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(client, payload, param, code) -> None:
    response = await client.post("/v1/generate", json=payload)
    assert response.status == 400
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


async def test_malformed_json_is_400(client) -> None:
    response = await client.post("/v1/generate", data=b"{not json")
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_json"


async def test_abort_by_post_ends_the_stream(client) -> None:
    response = await client.post("/v1/generate", json=body(max_tokens=1000))
    assert orjson.loads(await response.content.readline())["type"] == "start"
    assert orjson.loads(await response.content.readline())["type"] == "admitted"
    first = orjson.loads(await response.content.readline())
    assert first["type"] == "text"
    aborted = await client.post("/v1/abort", json={"request_id": "req-1"})
    assert await aborted.json() == {"aborted": True}
    lines = [first, *await read_lines(response)]
    finish, usage = lines[-2], lines[-1]
    assert finish["type"] == "finish" and finish["reason"] == "abort"
    # what the abort cost: at most the one step already running when it arrived
    assert finish["tail_tokens"] in (0, 1)
    assert 0 <= finish["stop_latency_ms"] < 10_000
    streamed = sum(line["tokens"] for line in lines if line["type"] == "text")
    assert finish["completion_tokens"] >= streamed
    assert usage["type"] == "usage" and usage["completion_tokens"] == finish["completion_tokens"]
    again = await client.post("/v1/abort", json={"request_id": "req-1"})
    assert await again.json() == {"aborted": False}


async def test_abort_refuses_a_body_without_request_id(client) -> None:
    response = await client.post("/v1/abort", json={"id": "x"})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "request_id"


async def test_closing_the_connection_aborts(client) -> None:
    response = await client.post("/v1/generate", json=body(max_tokens=1000))
    await response.content.readline()
    await response.content.readline()
    response.close()
    after = await wait_for_idle(client)
    assert await generated_tokens(client) < 200  # stopped long before max_tokens=1000
    assert (after["waiting"], after["running"], after["kv_blocks_used"]) == (0, 0, 0)
    assert after["kv_blocks_total"] > 0


async def test_a_client_gone_before_the_headers_is_a_disconnect_not_an_error(client) -> None:
    """A gateway closes a stream it began and will not read (its run's opening failed): the
    worker may find the connection gone as it sends its headers. That is an abort like any
    other hang-up, logged as one, and nothing is left running."""
    service = client.app[SERVICE]
    real, entered, release = service.generate, asyncio.Event(), asyncio.Event()

    async def held(request):  # the engine's first line waits until the client has gone
        entered.set()
        await release.wait()
        async for line in real(request):
            yield line

    service.generate = held
    request = orjson.dumps(body(max_tokens=1000))
    connections = client.server.runner.server.connections
    kept = len(connections)  # the test client's own, kept alive
    with capture_logs() as logs:
        _reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(
            b"POST /v1/generate HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(request)}\r\n\r\n".encode()
            + request
        )
        await entered.wait()
        writer.close()
        await writer.wait_closed()
        await until(lambda: len(connections) == kept, "the worker to see the connection gone")
        release.set()
        after = await wait_for_idle(client)
    assert [e["event"] for e in logs if e["log_level"] in ("error", "warning")] == []
    assert [e["event"] for e in logs if e.get("request_id") == "req-1"] == ["client disconnected"]
    assert (after["waiting"], after["running"], after["kv_blocks_used"]) == (0, 0, 0)
    assert await generated_tokens(client) < 1000  # stopped long before max_tokens


async def test_duplicate_live_request_id_is_400(client) -> None:
    first = await client.post("/v1/generate", json=body(max_tokens=1000))
    await first.content.readline()
    second = await client.post("/v1/generate", json=body())
    assert second.status == 400
    assert (await second.json())["error"]["param"] == "request_id"
    await client.post("/v1/abort", json={"request_id": "req-1"})
    await first.read()


async def test_metrics_have_the_worker_names(client) -> None:
    await (await client.post("/v1/generate", json=body())).read()
    text = await (await client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) >= WORKER_METRICS
    [generated] = families["sluice_worker_generated_tokens"].samples
    assert generated.value == 8
    steps = {s.name: s.value for s in families["sluice_worker_step_seconds"].samples}
    assert steps["sluice_worker_step_seconds_count"] == 8


async def test_two_apps_in_one_process_share_no_state(
    aiohttp_client, loaded, tiny_model_dir
) -> None:
    config = WorkerConfig(model=str(tiny_model_dir))
    one = await aiohttp_client(create_worker_app(config, loaded=loaded))
    two = await aiohttp_client(create_worker_app(config, loaded=loaded))
    await wait_healthy(one)
    await wait_healthy(two)
    await (await one.post("/v1/generate", json=body(max_tokens=5))).read()
    assert await generated_tokens(one) == 5
    assert await generated_tokens(two) == 0


async def test_not_ready_answers_503(aiohttp_client, tmp_path) -> None:
    client = await aiohttp_client(create_worker_app(WorkerConfig(model=str(tmp_path / "missing"))))
    await until(lambda: client.app[SERVICE].failed.is_set(), "the load to fail")
    assert (await client.get("/health")).status == 503
    response = await client.post("/v1/generate", json=body())
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "not_ready"


async def test_a_body_over_the_workers_limit_is_an_openai_shaped_413(
    aiohttp_client, loaded, tiny_model_dir
) -> None:
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", max_body_bytes=1024
    )
    client = await aiohttp_client(create_worker_app(config, loaded=loaded))
    await wait_healthy(client)
    big = [{"role": "user", "content": "x" * 2048}]
    response = await client.post("/v1/generate", json=body(messages=big))
    assert response.status == 413
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("request_too_large", None)
    response = await client.post("/v1/generate", json=body())  # under it: served as before
    assert response.status == 200
    await response.read()


async def test_the_engine_gets_the_step_time_target_of_the_device_the_model_is_on(client):
    """The default is resolved against where the model was loaded (here a CPU: 50 ms)."""
    engine = client.app[SERVICE]._require_engine()._engine
    assert engine.scheduler.step_budget is not None
    assert engine.scheduler.step_budget.target_s == 0.05
