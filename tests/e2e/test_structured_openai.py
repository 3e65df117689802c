"""End to end through the official `openai` client: structured output and a forced tool call,
enforced by our own worker (`sluice serve` on the tiny random model)."""

from __future__ import annotations

import json

import jsonschema

PROMPT = [{"role": "user", "content": "Give me a user record."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["viewer", "owner"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Bern", "Zürich"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}


def test_a_json_schema_answer_validates(client, model) -> None:
    answer = client.chat.completions.create(
        model=model, messages=PROMPT, response_format=FORMAT, seed=4, max_tokens=200
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_streamed_json_schema_answer_validates(client, model) -> None:
    stream = client.chat.completions.create(
        model=model, messages=PROMPT, response_format=FORMAT, seed=9, max_tokens=200, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_required_tool_call_streams_as_tool_call_deltas(client, model) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=PROMPT,
        tools=TOOLS,
        tool_choice="required",
        seed=2,
        max_tokens=200,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    [call] = calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_a_tool_call_round_trips_into_the_next_turn(client, model) -> None:
    first = client.chat.completions.create(
        model=model, messages=PROMPT, tools=TOOLS, tool_choice="required", seed=3, max_tokens=200
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    follow_up = [
        *PROMPT,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(  # greedy: the tiny model's EOS is never its argmax
        model=model,
        messages=follow_up,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].finish_reason == "length"
