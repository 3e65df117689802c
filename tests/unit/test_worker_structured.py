"""Structured output and forced tool calls on the real worker app (tiny random model).

A random-weight model writes garbage, so whatever it emits under a grammar is what the grammar
allows: every seed's output must validate against the schema (jsonschema), and a forced call's
arguments against the tool's parameters. Compilation runs off the engine thread: a compile that
hangs neither freezes the engine nor outlives its timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import orjson
import pytest

from tests.support.waiting import until
from tests.support.worker_app import started_worker_app
from workers.grammar import GrammarCompiler, GrammarSource

HI = [{"role": "user", "content": "Describe a user as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "admin": {"type": "boolean"},
        "role": {"enum": ["viewer", "editor", "owner"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{4}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "admin", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


def json_schema(schema: dict, name: str = "user") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def body(request_id: str, **overrides) -> dict:
    return {"request_id": request_id, "messages": HI, "max_tokens": 200, **overrides}


async def start_worker(aiohttp_client, loaded, tiny_model_dir, timeout_s: float = 5.0):
    return await started_worker_app(
        aiohttp_client, loaded, tiny_model_dir, grammar_timeout_s=timeout_s
    )


@pytest.fixture
async def client(aiohttp_client, loaded, tiny_model_dir):
    return await start_worker(aiohttp_client, loaded, tiny_model_dir)


async def generate(client, payload: dict) -> list[dict]:
    response = await client.post("/v1/generate", json=payload)
    assert response.status == 200, await response.text()
    return [orjson.loads(line) for line in (await response.read()).splitlines()]


def text_of(lines: list[dict], index: int = 0) -> str:
    return "".join(x["text"] for x in lines if x["type"] == "text" and x["index"] == index)


def finish_of(lines: list[dict], index: int = 0) -> str:
    [reason] = [x["reason"] for x in lines if x["type"] == "finish" and x["index"] == index]
    return reason


async def refusal(client, payload: dict) -> dict:
    response = await client.post("/v1/generate", json=payload)
    assert response.status == 400
    return (await response.json())["error"]


async def test_twenty_seeds_all_produce_json_that_validates(client) -> None:
    payloads = [
        body(f"seed-{seed}", seed=seed, temperature=1.0, response_format=json_schema(SCHEMA))
        for seed in range(20)
    ]
    results = await asyncio.gather(*(generate(client, p) for p in payloads))
    for lines in results:
        assert finish_of(lines) == "stop"  # ended by the grammar, not by max_tokens
        jsonschema.validate(json.loads(text_of(lines)), SCHEMA)


async def test_greedy_and_every_choice_of_n_follow_the_schema(client) -> None:
    greedy = await generate(
        client, body("greedy", temperature=0, response_format=json_schema(SCHEMA))
    )
    jsonschema.validate(json.loads(text_of(greedy)), SCHEMA)
    lines = await generate(client, body("n3", n=3, seed=7, response_format=json_schema(SCHEMA)))
    for index in range(3):
        assert finish_of(lines, index) == "stop"
        jsonschema.validate(json.loads(text_of(lines, index)), SCHEMA)


async def test_json_object_is_an_object(client) -> None:
    lines = await generate(client, body("obj", seed=1, response_format={"type": "json_object"}))
    text = text_of(lines)
    assert text.startswith("{")
    if finish_of(lines) == "stop":
        assert isinstance(json.loads(text), dict)


async def test_max_tokens_can_still_cut_the_json_short(client) -> None:
    lines = await generate(client, body("cut", max_tokens=4, response_format=json_schema(SCHEMA)))
    assert finish_of(lines) == "length"
    assert '{"name": "'.startswith(text_of(lines))  # a prefix of what the schema begins with


async def test_tool_choice_required_makes_a_valid_call_for_twenty_seeds(client) -> None:
    payloads = [
        body(f"tool-{seed}", seed=seed, tools=TOOLS, tool_choice="required") for seed in range(20)
    ]
    for lines in await asyncio.gather(*(generate(client, p) for p in payloads)):
        [call] = [x for x in lines if x["type"] == "tool_call"]
        assert (call["index"], call["call_index"]) == (0, 0)
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
        assert text_of(lines) == ""  # the markup never shows as text
        assert finish_of(lines) == "tool_calls"
        tokens = sum(x.get("tokens", 0) for x in lines if x["type"] in ("text", "tool_call"))
        assert tokens == lines[-1]["completion_tokens"]


async def test_a_named_function_is_the_one_called(client) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    payload = body("named", seed=3, tools=TOOLS, tool_choice=choice)
    lines = await generate(client, payload)
    [call] = [x for x in lines if x["type"] == "tool_call"]
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), TIME)


async def test_tool_choice_none_does_not_show_the_tools(client) -> None:
    plain = await generate(client, body("plain", max_tokens=1))
    none = await generate(client, body("none", max_tokens=1, tools=TOOLS, tool_choice="none"))
    auto = await generate(client, body("auto", max_tokens=1, tools=TOOLS))
    assert none[0]["prompt_tokens"] == plain[0]["prompt_tokens"] < auto[0]["prompt_tokens"]


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "not": {"required": ["a"]}}, ["not"]),
        ({"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, ["uniqueItems"]),
    ],
)
async def test_unsupported_schema_keywords_are_a_400_naming_them(client, schema, named) -> None:
    error = await refusal(client, body("bad", response_format=json_schema(schema)))
    assert error["param"] == "response_format.json_schema.schema"
    assert error["code"] == "unsupported_parameter"
    assert all(word in error["message"] for word in named)


async def test_a_tool_with_unsupported_parameters_is_named(client) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
    error = await refusal(client, body("bad", tools=[TOOLS[0], bad], tool_choice="required"))
    assert (error["param"], error["code"]) == (
        "tools[1].function.parameters",
        "unsupported_parameter",
    )


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name"),
        ({"response_format": json_schema({"type": "nonsense"})},
         "response_format.json_schema.schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": json_schema(SCHEMA)},
         "response_format"),
    ],
)  # fmt: skip
async def test_bad_formats_and_tools_are_a_400_naming_the_field(client, overrides, param) -> None:
    error = await refusal(client, body("bad", **overrides))
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


async def test_a_named_tool_choice_is_repeated_cut_short(client) -> None:
    name = "x" * 10_000
    choice = {"type": "function", "function": {"name": name}}
    error = await refusal(client, body("bad", tools=TOOLS, tool_choice=choice))
    assert error["message"].endswith(f"no tool is named '{'x' * 40}…'")


class HangingCompile:
    """Makes `GrammarCompiler.build` hang on a schema titled `slow-compile` until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        original = GrammarCompiler.build

        def build(compiler: GrammarCompiler, source: GrammarSource):
            if "slow-compile" in source.text:
                self.entered.set()
                self.release.wait()
            return original(compiler, source)

        monkeypatch.setattr(GrammarCompiler, "build", build)


SLOW = json_schema({"title": "slow-compile", "type": "object"})


async def test_a_hanging_compile_does_not_freeze_the_engine(
    aiohttp_client, loaded, tiny_model_dir, monkeypatch
) -> None:
    hang = HangingCompile(monkeypatch)
    client = await start_worker(aiohttp_client, loaded, tiny_model_dir, timeout_s=120)
    slow = asyncio.ensure_future(
        client.post("/v1/generate", json=body("slow", response_format=SLOW))
    )
    try:
        await until(hang.entered.is_set, "the slow compile to start")
        lines = await generate(client, body("other", max_tokens=8, temperature=0))
        assert lines[-1]["type"] == "usage"  # done while the other one still compiles
        assert not slow.done()
    finally:
        hang.release.set()
    response = await slow
    assert response.status == 200
    await response.read()


async def test_a_compile_past_the_timeout_is_a_400(
    aiohttp_client, loaded, tiny_model_dir, monkeypatch
) -> None:
    hang = HangingCompile(monkeypatch)
    client = await start_worker(aiohttp_client, loaded, tiny_model_dir, timeout_s=0.2)
    try:
        error = await refusal(client, body("slow", response_format=SLOW))
        assert (error["param"], error["code"]) == (
            "response_format.json_schema.schema",
            "schema_too_complex",
        )
        lines = await generate(client, body("after", response_format=json_schema(SCHEMA)))
        jsonschema.validate(json.loads(text_of(lines)), SCHEMA)  # the pool still compiles
    finally:
        hang.release.set()
