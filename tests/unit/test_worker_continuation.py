"""`continuation` through the worker app and the gateway's adapter: the body field is validated
and named, the stream of a continued run completes the interrupted one (the `start` and `usage`
lines as for an uninterrupted run), and `ids` reach the adapter's events."""

from __future__ import annotations

import orjson
import pytest

from adapters.events import TextDelta, ToolCallDelta
from adapters.requests import ChatRequest, Message
from adapters.worker_client import generate_request, to_event
from tests.support.worker_app import started_worker_app
from wire import api
from wire.api import BadRequest
from wire.generate_body import MAX_CONTINUATION, parse_generate

HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
async def client(aiohttp_client, loaded, tiny_model_dir):
    return await started_worker_app(aiohttp_client, loaded, tiny_model_dir)


def body(request_id: str = "r", **overrides) -> dict:
    return {
        "request_id": request_id,
        "messages": HI,
        "max_tokens": 12,
        "temperature": 0,
        **overrides,
    }


async def generate(client, payload: dict) -> list[dict]:
    response = await client.post("/v1/generate", json=payload)
    assert response.status == 200, await response.text()
    return [orjson.loads(line) for line in (await response.read()).splitlines()]


async def refusal(client, payload: dict) -> dict:
    response = await client.post("/v1/generate", json=payload)
    assert response.status == 400
    return (await response.json())["error"]


def content(lines: list[dict]) -> list[dict]:
    return [x for x in lines if x["type"] in ("text", "tool_call")]


# -- the body --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["1, 2", [1, "2"], [1.0], [True], [-1], {"ids": [1]}, [[1]]], ids=repr
)
def test_a_continuation_must_be_a_list_of_ids(value) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_generate(body(continuation=value))
    assert (refused.value.param, refused.value.code) == ("continuation", "invalid_type")


def test_a_continuation_is_of_one_choice_and_bounded() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_generate(body(n=2, continuation=[5]))
    assert refused.value.param == "continuation"
    with pytest.raises(BadRequest) as refused:
        parse_generate(body(continuation=[0] * (MAX_CONTINUATION + 1)))
    assert refused.value.param == "continuation"
    assert parse_generate(body(n=2, continuation=[])).continuation == ()  # nothing to continue
    assert parse_generate(body(continuation=None)).continuation == ()
    assert parse_generate(body(continuation=[0, 7])).continuation == (0, 7)


def test_the_adapter_sends_the_continuation_only_when_set() -> None:
    request = ChatRequest("m", [Message("user", "Hi")], max_tokens=5)
    assert "continuation" not in orjson.loads(generate_request(request, "r").to_json())
    request.continuation = [4, 2]
    sent = orjson.loads(generate_request(request, "r").to_json())
    assert sent["continuation"] == [4, 2]
    assert parse_generate(sent).continuation == (4, 2)


def test_the_adapter_passes_the_ids_on() -> None:
    text = to_event(api.decode(api.encode(api.TextLine("ab", 0, 2, token_ids=[7, 9]))))
    assert text == TextDelta("ab", 0, 2, None, [7, 9])
    call = to_event(api.ToolCallLine(0, "{}", "f", 0, 3, token_ids=[1, 2, 3]))
    assert isinstance(call, ToolCallDelta) and call.token_ids == [1, 2, 3]


# -- the worker ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"continuation": [600]}, "invalid_value"),  # the tiny model's vocabulary is 600
        ({"continuation": "x"}, "invalid_type"),
        ({"n": 2, "continuation": [1]}, "invalid_value"),
        ({"max_tokens": 2, "continuation": [5, 6, 7]}, "context_length_exceeded"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA},
                },
                "continuation": [5, 6, 7],
            },
            "invalid_value",
        ),
    ],
)
async def test_a_bad_continuation_is_a_400_naming_it(client, overrides, code) -> None:
    error = await refusal(client, body(**overrides))
    assert (error["param"], error["code"]) == ("continuation", code)


async def test_a_continued_stream_completes_the_interrupted_one(client) -> None:
    whole = await generate(client, body("whole"))
    lines = content(whole)
    assert all(len(x["ids"]) == x["tokens"] for x in lines)
    cut = len(lines) // 2
    ids = [t for x in lines[:cut] for t in x["ids"]]
    continued = await generate(client, body("continued", continuation=ids))
    assert continued[0] == whole[0]  # `start`: the prompt's tokens, not the continuation's
    assert lines[:cut] + content(continued) == lines
    assert continued[-2:] == whole[-2:]  # finish and usage: all 12 tokens, as uninterrupted
    assert whole[-1] == {
        "type": "usage",
        "prompt_tokens": whole[0]["prompt_tokens"],
        "completion_tokens": 12,
    }


async def test_a_token_after_the_end_is_an_error_line(client) -> None:
    lines = await generate(client, body(stop_token_ids=[5], continuation=[5, 6]))
    assert [x["type"] for x in lines] == ["start", "error"]
    assert lines[-1]["code"] == "invalid_continuation"


def test_an_open_final_message_is_continued_only_when_it_is_the_assistants() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_generate(body(continue_final_message=True))
    assert refused.value.param == "continue_final_message"
    opened = body(continue_final_message=True)
    opened["messages"] = [*opened["messages"], {"role": "assistant", "content": "Hel"}]
    assert parse_generate(opened).continue_final_message
    request = ChatRequest("m", [Message("user", "Hi"), Message("assistant", "Hel")])
    assert "continue_final_message" not in orjson.loads(generate_request(request, "r").to_json())
    request.continue_final_message = True
    sent = orjson.loads(generate_request(request, "r").to_json())
    assert sent["continue_final_message"] is True
