"""End to end through the official `openai` client's Responses API, against `sluice serve` and
its own worker on the tiny model: create (stream and not), background runs, resume after a
drop, cancel, conversations by `previous_response_id`, structured output, tool calls, and bad
input refused with nothing left behind."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.test_structured_openai import SCHEMA, WEATHER
from tests.support.waiting import until_sync

PROMPT = "Tell me a story about 你好 and café."


def worker_idle(served) -> dict | None:
    stats = httpx.get(f"{served.worker_url()}/v1/stats").json()
    return None if stats["running"] or stats["waiting"] else stats


@pytest.fixture(scope="module")
def greedy(client, model):
    """The reference answer: greedy, 24 tokens, not streamed."""
    return client.responses.create(model=model, input=PROMPT, temperature=0, max_output_tokens=24)


def test_a_response_and_its_usage(greedy):
    assert greedy.id.startswith("resp_") and greedy.object == "response"
    assert greedy.status == "incomplete"  # it stopped at max_output_tokens
    assert greedy.incomplete_details.reason == "max_output_tokens"
    assert greedy.output_text
    assert greedy.usage.output_tokens == 24 and greedy.usage.input_tokens > 5


def test_a_stream_is_numbered_events_that_end_with_the_same_response(client, model, greedy):
    stream = client.responses.create(
        model=model, input=PROMPT, temperature=0, max_output_tokens=24, stream=True
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == greedy.output_text == events[-1].response.output_text


def test_background_then_retrieve_until_completed(client, model, greedy):
    created = client.responses.create(
        model=model, input=PROMPT, temperature=0, max_output_tokens=24, background=True
    )
    assert created.background is True and created.status in ("queued", "in_progress")

    def ended():
        response = client.responses.retrieve(created.id)
        return response if response.status not in ("queued", "in_progress") else None

    response = until_sync(ended, "the background response to end", within=30)
    assert response.status == "incomplete"
    assert response.output_text == greedy.output_text


def test_retrieve_after_a_drop_gives_exactly_the_missing_events(client, model):
    stream = client.responses.create(
        model=model, input=PROMPT, temperature=0, max_output_tokens=40, stream=True
    )
    events = iter(stream)
    head = [next(events) for _ in range(7)]
    stream.close()  # the connection drops; the run goes on within its grace window
    rid = head[0].response.id
    rest = list(
        client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number)
    )
    whole = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in head + rest] == list(range(len(whole)))
    assert [e.model_dump() for e in head + rest] == [e.model_dump() for e in whole]


def test_cancel_mid_run_stops_the_worker(client, model, served):
    created = client.responses.create(
        model=model, input=PROMPT, temperature=0, max_output_tokens=900, background=True
    )
    until_sync(
        lambda: client.responses.retrieve(created.id).output_text, "the first text", within=30
    )
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < 900
    stats = until_sync(lambda: worker_idle(served), "the worker to go idle")
    assert stats["kv_blocks_used"] == 0  # the worker dropped the sequence
    assert client.responses.retrieve(created.id).status == "cancelled"


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input=PROMPT, temperature=0, max_output_tokens=12)
    second = client.responses.create(
        model=model,
        input="And then?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=12,
    )
    assert second.previous_response_id == first.id
    alone = client.responses.create(
        model=model, input="And then?", temperature=0, max_output_tokens=12
    )
    # the second turn's prompt holds the first turn's input and output
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And then?"]


def test_structured_output_through_text_format(client, model):
    response = client.responses.create(
        model=model,
        input="Give me a user record.",
        text={"format": {"type": "json_schema", "name": "user", "schema": SCHEMA, "strict": True}},
        max_output_tokens=200,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_a_required_tool_call_is_a_function_call_item(client, model):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    stream = client.responses.create(
        model=model,
        input="What is the weather?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=200,
        stream=True,
    )
    events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert done[0].arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model=model,
        previous_response_id=events[-1].response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,  # greedy: a sampled answer may draw EOS within its 8 tokens
    )
    assert answer.status == "incomplete" and answer.output[0].type == "message"


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
            "text.format.schema",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_leaves_nothing(
    client, model, served, overrides, param
):
    body = {"model": model, "input": PROMPT, "max_output_tokens": 8} | overrides
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**body)
    assert raised.value.body["param"] == param
    stats = until_sync(lambda: worker_idle(served), "the worker to be idle")
    assert stats["kv_blocks_used"] == 0
