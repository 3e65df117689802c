"""End to end through the official `anthropic` client, unchanged, against `sluice serve` and its
own worker on the tiny model: create (stream and not), a tool-use round trip with the worker's
own tool-call parsing and schema check, stop sequences named, message_start's input tokens,
count_tokens by the worker's own tokenizer, and a dropped stream cancelling its run."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import DISCONNECT_GRACE, E2E_KEY
from tests.e2e.test_structured_openai import WEATHER
from tests.support.waiting import until_sync

GREEDY = {"temperature": 0}  # this SDK's create() no longer names it; the API still takes it
PROMPT = [{"role": "user", "content": "Tell me a story about 你好 and café."}]
TOOL = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}


@pytest.fixture(scope="module")
def claude(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.root, api_key=E2E_KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy(claude, model) -> anthropic.types.Message:
    return claude.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=PROMPT)


def test_a_message_and_its_usage(greedy, model):
    assert greedy.id.startswith("msg_") and greedy.model == model
    assert greedy.stop_reason == "max_tokens"
    assert greedy.content[0].type == "text" and greedy.content[0].text
    assert greedy.usage.output_tokens == 24 and greedy.usage.input_tokens > 5


def test_the_stream_tells_the_same_message(claude, model, greedy):
    with claude.messages.stream(
        model=model, max_tokens=24, extra_body=GREEDY, messages=PROMPT
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24


def test_top_k_one_is_greedy(claude, model, greedy):
    sampled = claude.messages.create(
        model=model, max_tokens=24, messages=PROMPT, extra_body={"top_k": 1, "temperature": 1}
    )
    assert sampled.content[0].text == greedy.content[0].text


def test_tool_use_round_trip(claude, model):
    first = claude.messages.create(
        model=model,
        max_tokens=200,
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=[TOOL],
        tool_choice={"type": "any"},
    )
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)  # released only whole and valid
    question = [{"role": "user", "content": "What is the weather?"}]
    turns = [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    options = {"model": model, "max_tokens": 8, "tools": [TOOL], "tool_choice": {"type": "none"}}
    # greedy: sampled, the answer may draw the tiny model's EOS first and have no text block
    answer = claude.messages.create(messages=question + turns, extra_body=GREEDY, **options)
    alone = claude.messages.create(messages=question, extra_body=GREEDY, **options)
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"
    # the call and its result went into the prompt
    assert answer.usage.input_tokens > alone.usage.input_tokens + 5


def test_count_tokens_is_the_workers_count_of_what_a_create_takes(claude, model, greedy):
    raw = claude.messages.with_raw_response.count_tokens(model=model, messages=PROMPT)
    assert raw.headers["x-sluice-token-count"] == "worker"
    assert raw.parse().input_tokens == greedy.usage.input_tokens
    options = {"system": "Be brief.", "tools": [TOOL], "tool_choice": {"type": "auto"}}
    counted = claude.messages.count_tokens(model=model, messages=PROMPT, **options)
    created = claude.messages.create(model=model, max_tokens=1, messages=PROMPT, **options)
    assert counted.input_tokens == created.usage.input_tokens > greedy.usage.input_tokens


@pytest.fixture(scope="module")
def stop(greedy) -> str:
    """A piece of the greedy text, well inside it: a run asked to stop there ends on it."""
    text = greedy.content[0].text
    piece = text[len(text) // 3 : len(text) // 3 + 3]
    assert piece.strip()
    return piece


def test_a_matched_stop_sequence_is_named(claude, model, greedy, stop):
    message = claude.messages.create(
        model=model,
        max_tokens=24,
        extra_body=GREEDY,
        messages=PROMPT,
        stop_sequences=["\u0000never", stop],
    )
    text = greedy.content[0].text
    assert message.content[0].text == text[: text.find(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_the_stream_names_the_stop_sequence_and_starts_with_the_input_tokens(
    claude, model, greedy, stop
):
    with claude.messages.stream(
        model=model, max_tokens=24, extra_body=GREEDY, messages=PROMPT, stop_sequences=[stop]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    [delta] = [e for e in events if e.type == "message_delta"]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", stop)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == final.usage.input_tokens
    assert final.usage.input_tokens == greedy.usage.input_tokens


def test_the_chat_api_names_the_stop_string_as_vllm_does(served, model, stop):
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "stop": [stop],
    }
    answer = httpx.post(f"{served.base_url}/chat/completions", json=body, headers=served.auth)
    choice = answer.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_a_dropped_stream_cancels_its_run(claude, model, served):
    stream = claude.messages.create(
        model=model, max_tokens=900, extra_body=GREEDY, messages=PROMPT, stream=True
    )
    run_id = stream.response.headers["x-sluice-run-id"]
    events = iter(stream)
    assert next(events).type == "message_start"
    next(events)
    stream.close()  # the connection drops: the run is cancelled once the grace window passes

    def ended():
        run = httpx.get(f"{served.base_url}/chat/completions/{run_id}", headers=served.auth)
        return run.json() if run.json().get("status") != "in_progress" else None

    run = until_sync(ended, "the dropped run to end", within=10 + DISCONNECT_GRACE)
    assert run["status"] == "cancelled"
    stats = until_sync(lambda: _idle(served), "the worker to go idle")
    assert stats["kv_blocks_used"] == 0


def _idle(served) -> dict | None:
    stats = httpx.get(f"{served.worker_url()}/v1/stats").json()
    return None if stats["running"] or stats["waiting"] else stats
