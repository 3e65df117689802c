"""The worker's `POST /v1/count` and the `stop_string` of its `finish` lines (docs/worker-api.md),
through the real worker app on the tiny model."""

from __future__ import annotations

import orjson
import pytest

from tests.support.worker_app import started_worker_app
from tests.unit.test_worker_structured import TOOLS

HI = [{"role": "user", "content": "Hi, tell me a story about café and 你好."}]


@pytest.fixture
async def client(aiohttp_client, loaded, tiny_model_dir):
    return await started_worker_app(aiohttp_client, loaded, tiny_model_dir)


def body(request_id: str, **overrides) -> dict:
    return {
        "request_id": request_id,
        "messages": HI,
        "max_tokens": 24,
        "temperature": 0,
        **overrides,
    }


async def generate(client, payload: dict) -> list[dict]:
    response = await client.post("/v1/generate", json=payload)
    assert response.status == 200, await response.text()
    return [orjson.loads(line) for line in (await response.read()).splitlines()]


async def count(client, payload: dict) -> int:
    response = await client.post("/v1/count", json=payload)
    assert response.status == 200, await response.text()
    answer = await response.json()
    assert set(answer) == {"input_tokens"}
    return answer["input_tokens"]


def text_of(lines: list[dict]) -> str:
    return "".join(x["text"] for x in lines if x["type"] == "text")


def finish_of(lines: list[dict]) -> dict:
    [finish] = [x for x in lines if x["type"] == "finish"]
    return finish


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}],
    ids=["plain", "tools", "tools-not-shown"],
)
async def test_a_count_is_the_prompt_tokens_a_generation_reports(client, extra) -> None:
    counted = await count(client, body("count", **extra))
    lines = await generate(client, body("gen", max_tokens=1, **extra))
    assert lines[0] == {"type": "start", "prompt_tokens": counted}
    assert lines[-1]["prompt_tokens"] == counted


async def test_tools_shown_to_the_model_are_counted(client) -> None:
    plain = await count(client, body("plain"))
    assert await count(client, body("tools", tools=TOOLS)) > plain + 10


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (body("bad", messages="Hi"), "messages"),
        (body("bad", messages=[{"role": "robot", "content": "x"}]), "messages"),
        ({"messages": HI}, "request_id"),
        (body("bad", temperature=-1), "temperature"),
        (body("bad", tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
        ([1, 2], None),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(client, payload, param) -> None:
    response = await client.post("/v1/count", json=payload)
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


async def test_a_finish_names_the_stop_string_that_ended_it(client) -> None:
    free = text_of(await generate(client, body("free")))
    stop = free[6:10]  # a piece of the greedy text: generation stops at its first occurrence
    assert stop.strip()
    lines = await generate(client, body("stopped", stop=["\x00never", stop]))
    assert text_of(lines) == free[: free.find(stop)]
    finish = finish_of(lines)
    assert (finish["reason"], finish["stop_string"]) == ("stop", stop)


async def test_a_finish_without_a_stop_string_has_no_field(client) -> None:
    lines = await generate(client, body("capped", max_tokens=4, stop=["\x00never"]))
    finish = finish_of(lines)
    assert finish["reason"] == "length" and "stop_string" not in finish
