"""The tool-call stage: fragments in, whole and valid calls out, or one error and nothing more."""

from __future__ import annotations

import pytest

from adapters.events import ErrorEvent, Event, Finish, TextDelta, ToolCallDelta, Usage
from adapters.requests import ChatRequest, Message
from gateway.http.errors import APIError
from gateway.runs.tool_calls import INVALID_TOOL_CALL, check_tool_parameters, tool_call_stage

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
SECRET = "model-text-4b1d"


def tool(name: str, parameters: dict | None = None) -> dict:
    function: dict = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def nested(schema: dict, levels: int) -> dict:
    """`schema` under `{"not": …}` until its JSON nests `levels` deep."""
    for _ in range(levels - 1):
        schema = {"not": schema}
    return schema


def make_chat(tools=None, n: int = 1, tool_choice=None) -> ChatRequest:
    tools = [tool("get_weather", WEATHER), tool("get_time")] if tools is None else tools
    return ChatRequest("m", [Message("user", "hi")], n=n, tools=tools, tool_choice=tool_choice)


def fragments(arguments: str, pieces: int, call_index: int = 0, index: int = 0) -> list[Event]:
    size = -(-len(arguments) // pieces)
    parts = [arguments[k * size : (k + 1) * size] for k in range(pieces)]
    return [ToolCallDelta(call_index, p, index=index) for p in parts]


def opening(call_id: str, name: str, call_index: int = 0, index: int = 0) -> ToolCallDelta:
    return ToolCallDelta(call_index, "", call_id, name, index)


async def run_stage(chat: ChatRequest, *batches: list[Event]) -> list[Event]:
    """Everything the stage releases for these batches, its `finish` included."""
    stage = tool_call_stage(chat)
    assert stage is not None
    out: list[Event] = []
    for batch in batches:
        out += await stage.feed(batch)
    return out + await stage.finish()


def only_error(events: list[Event]) -> ErrorEvent:
    (error,) = [e for e in events if type(e) is ErrorEvent]
    assert not [e for e in events if type(e) is ToolCallDelta]  # never half a call
    assert events[-1] is error  # nothing after it
    assert error.code == INVALID_TOOL_CALL
    assert SECRET not in error.message
    return error


async def test_twenty_fragments_become_one_complete_call():
    arguments = '{"city": "Paris", "days": 3}'
    batches = [[opening("call_1", "get_weather")]] + [[f] for f in fragments(arguments, 20)]
    out = await run_stage(make_chat(), *batches, [Finish("tool_calls"), Usage(5, 9)])
    assert out == [
        ToolCallDelta(0, arguments, "call_1", "get_weather", 0),
        Finish("tool_calls"),
        Usage(5, 9),
    ]


async def test_nothing_is_released_before_the_choice_finishes():
    stage = tool_call_stage(make_chat())
    assert await stage.feed([opening("call_1", "get_weather"), ToolCallDelta(0, '{"city": ')]) == []
    assert await stage.feed([ToolCallDelta(0, '"Oslo"}')]) == []
    out = await stage.feed([Finish("stop")])
    assert out == [
        ToolCallDelta(0, '{"city": "Oslo"}', "call_1", "get_weather"),
        Finish("tool_calls"),
    ]


async def test_two_interleaved_calls_come_out_whole_and_in_order():
    first, second = '{"city": "Rome"}', '{"zone": "UTC"}'
    a, b = fragments(first, 4, 0), fragments(second, 4, 1)
    batch: list[Event] = [opening("call_a", "get_weather", 0), opening("call_b", "get_time", 1)]
    for pair in zip(a, b, strict=True):
        batch += pair
    out = await run_stage(make_chat(), batch, [Finish("tool_calls")])
    assert out == [
        ToolCallDelta(0, first, "call_a", "get_weather"),
        ToolCallDelta(1, second, "call_b", "get_time"),
        Finish("tool_calls"),
    ]


async def test_each_choice_is_judged_and_released_on_its_own():
    batch: list[Event] = [
        opening("call_0", "get_weather", index=0),
        opening("call_1", "get_weather", index=1),
        *fragments('{"city": "Lima"}', 5, index=1),
        *fragments('{"city": "Kyiv"}', 5, index=0),
        Finish("tool_calls", 1),
    ]
    stage = tool_call_stage(make_chat(n=2))
    assert await stage.feed(batch) == [
        ToolCallDelta(0, '{"city": "Lima"}', "call_1", "get_weather", 1),
        Finish("tool_calls", 1),
    ]
    assert await stage.feed([Finish("tool_calls", 0)]) == [
        ToolCallDelta(0, '{"city": "Kyiv"}', "call_0", "get_weather", 0),
        Finish("tool_calls", 0),
    ]


async def test_text_passes_through_unchanged_and_at_once():
    stage = tool_call_stage(make_chat(n=2))
    text = [TextDelta("Let me check", 0, 3), TextDelta("Hi", 1)]
    assert await stage.feed(text) == text
    assert await stage.feed([Finish("stop", 1)]) == [Finish("stop", 1)]  # no calls: unchanged


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
async def test_a_choice_that_made_calls_finishes_with_tool_calls(reason):
    out = await run_stage(
        make_chat(), [opening("c", "get_time"), ToolCallDelta(0, "{}"), Finish(reason)]
    )
    assert out[-1] == Finish("tool_calls")


async def test_a_stream_that_ends_without_a_finish_still_releases_its_calls():
    out = await run_stage(
        make_chat(), [opening("c", "get_weather"), ToolCallDelta(0, '{"city":"x"}')]
    )
    assert out == [ToolCallDelta(0, '{"city":"x"}', "c", "get_weather"), Finish("tool_calls")]


async def test_missing_id_gets_one_and_empty_arguments_become_an_empty_object():
    out = await run_stage(make_chat(), [ToolCallDelta(0, "", None, "get_time"), Finish("stop")])
    call = out[0]
    assert call.id.startswith("call_") and len(call.id) > 10
    assert (call.name, call.arguments) == ("get_time", "{}")


async def test_model_indexes_are_renumbered_from_zero():
    batch = [opening("c5", "get_time", 5), opening("c2", "get_time", 2), Finish("stop")]
    out = await run_stage(make_chat(), batch)
    assert [(c.call_index, c.id) for c in out[:2]] == [(0, "c2"), (1, "c5")]


async def test_arguments_that_are_not_json_end_the_run():
    batch = [opening("c", "get_weather"), ToolCallDelta(0, '{"city": "' + SECRET), Finish("stop")]
    error = only_error(await run_stage(make_chat(), batch))
    assert (
        error.message
        == "The model called tool 'get_weather' with arguments that are not valid JSON."
    )


async def test_arguments_that_are_not_an_object_end_the_run():
    batch = [opening("c", "get_weather"), ToolCallDelta(0, f'["{SECRET}"]'), Finish("stop")]
    error = only_error(await run_stage(make_chat(), batch))
    assert "not an object" in error.message


@pytest.mark.parametrize(
    ("arguments", "rule"),
    [
        ('{"days": 2}', "the 'required' rule at required"),
        ('{"city": 7}', "the 'type' rule at properties/city/type"),
        ('{"city": "x", "days": 0}', "the 'minimum' rule at properties/days/minimum"),
        (f'{{"city": "x", "{SECRET}": 1}}', "the 'additionalProperties' rule"),
    ],
)
async def test_arguments_that_fail_the_schema_end_the_run(arguments, rule):
    batch = [opening("c", "get_weather"), *fragments(arguments, 3), Finish("tool_calls")]
    error = only_error(await run_stage(make_chat(), batch))
    assert error.message.startswith(
        "The model called tool 'get_weather' with arguments that do not match its parameters"
    )
    assert rule in error.message


async def test_one_bad_call_withholds_the_good_calls_of_its_choice():
    batch = [
        opening("a", "get_weather", 0),
        ToolCallDelta(0, '{"city": "ok"}'),
        opening("b", "get_weather", 1),
        ToolCallDelta(1, "{}", index=0),
        Finish("tool_calls"),
        TextDelta("after"),
    ]
    only_error(await run_stage(make_chat(), batch))


async def test_after_an_error_the_stage_releases_nothing():
    stage = tool_call_stage(make_chat(n=2))
    await stage.feed([opening("c", "nope"), Finish("stop")])
    assert await stage.feed([TextDelta("more", 1), Finish("stop", 1)]) == []
    assert await stage.finish() == []


async def test_an_unknown_tool_ends_the_run_naming_it():
    error = only_error(
        await run_stage(make_chat(), [opening("c", "launch_rocket"), Finish("stop")])
    )
    assert error.message == "The model called a tool 'launch_rocket' the request does not offer."


async def test_an_unknown_tool_with_an_odd_name_is_not_quoted():
    error = only_error(
        await run_stage(make_chat(), [opening("c", f"{SECRET} <x>"), Finish("stop")])
    )
    assert "with an invalid name" in error.message


async def test_a_call_without_a_name_ends_the_run():
    only_error(await run_stage(make_chat(), [ToolCallDelta(0, "{}", "c"), Finish("stop")]))


async def test_tool_choice_limits_which_tools_may_be_called():
    named = {"type": "function", "function": {"name": "get_time"}}
    batch = [opening("c", "get_weather"), ToolCallDelta(0, '{"city": "x"}'), Finish("stop")]
    error = only_error(await run_stage(make_chat(tool_choice=named), batch))
    assert "'tool_choice'" in error.message
    only_error(await run_stage(make_chat(tool_choice="none"), batch))


async def test_a_tool_without_parameters_takes_any_object():
    out = await run_stage(make_chat(), [opening("c", "get_time"), ToolCallDelta(0, '{"a": [1]}')])
    assert out[0].arguments == '{"a": [1]}'


def test_no_tools_no_stage():
    assert tool_call_stage(make_chat(tools=[])) is None
    assert tool_call_stage(ChatRequest("m", [Message("user", "hi")])) is None


def test_a_draft_7_schema_is_judged_as_draft_7():
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"xs": {"type": "array", "items": [{"type": "integer"}]}},
    }
    check_tool_parameters([tool("f", schema)])  # tuple `items` is valid in draft 7 only
    with pytest.raises(APIError):
        check_tool_parameters([tool("f", {k: v for k, v in schema.items() if k != "$schema"})])


@pytest.mark.parametrize(
    ("parameters", "code", "detail"),
    [
        ({"type": "objekt"}, "invalid_tool_schema", "at type:"),
        ({"properties": {"a": {"minimum": "one"}}}, "invalid_tool_schema", "properties/a/minimum"),
        (
            {"properties": {"a": {"$ref": "https://example.com/s.json"}}},
            "invalid_tool_schema",
            "not local",
        ),
        (
            {"properties": {"a": {"$ref": "#/$defs/missing"}}},
            "invalid_tool_schema",
            "does not resolve",
        ),
        ("object", "invalid_type", "expected a JSON Schema object"),
        ({"$schema": []}, "invalid_tool_schema", "at $schema: '$schema' must be a string"),
        ({"$schema": {}}, "invalid_tool_schema", "at $schema: '$schema' must be a string"),
        ({"$schema": 5}, "invalid_tool_schema", "at $schema: '$schema' must be a string"),
        ({"$schema": None}, "invalid_tool_schema", "at $schema: '$schema' must be a string"),
        (nested({"type": "object"}, 65), "invalid_tool_schema", "nests deeper than 64 levels"),
    ],
)
def test_an_invalid_schema_is_refused_naming_its_field(parameters, code, detail):
    tools = [tool("get_time"), tool("f", parameters)]
    with pytest.raises(APIError) as caught:
        check_tool_parameters(tools)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "tools[1].function.parameters", code)
    assert detail in error.message


def test_a_schema_64_levels_deep_is_accepted():
    check_tool_parameters([tool("f", nested({"type": "object"}, 64))])


def test_valid_schemas_and_local_refs_are_accepted():
    defs = {"$defs": {"city": {"type": "string"}}, "properties": {"c": {"$ref": "#/$defs/city"}}}
    check_tool_parameters([tool("a"), tool("b", WEATHER), tool("c", {"type": "object", **defs})])


async def test_a_local_ref_is_followed_when_judging_a_call():
    schema = {
        "type": "object",
        "$defs": {"city": {"type": "string"}},
        "properties": {"c": {"$ref": "#/$defs/city"}},
    }
    chat = make_chat(tools=[tool("f", schema)])
    only_error(await run_stage(chat, [opening("x", "f"), ToolCallDelta(0, '{"c": 1}')]))
    out = await run_stage(chat, [opening("x", "f"), ToolCallDelta(0, '{"c": "Nice"}')])
    assert out[0].arguments == '{"c": "Nice"}'


async def test_a_ref_cycle_fails_the_call_it_judges():
    schema = {"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "$ref": "#/$defs/loop"}
    chat = make_chat(tools=[tool("f", schema)])
    error = only_error(await run_stage(chat, [opening("x", "f"), ToolCallDelta(0, "{}")]))
    assert error.message == (
        "The model called tool 'f' with arguments its parameters schema cannot judge "
        "(a '$ref' cycle, or arguments nested too deeply)."
    )


async def test_arguments_nested_past_the_stack_fail_a_recursive_schema():
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    arguments = '{"a": ' * 1000 + "{}" + "}" * 1000
    chat = make_chat(tools=[tool("f", schema)])
    error = only_error(await run_stage(chat, [opening("x", "f"), ToolCallDelta(0, arguments)]))
    assert "cannot judge" in error.message
