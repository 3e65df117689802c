"""Events → chunk and completion objects, checked against the openai SDK's own types."""

from __future__ import annotations

import orjson
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from adapters.chat_chunks import ChunkRenderer, CompletionBuilder, chunk_events, completion_chunks
from adapters.events import Finish, TextDelta, ToolCallDelta, Usage


def chunk(raw: bytes) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(orjson.loads(raw))


def test_chunks_have_openais_shape():
    r = ChunkRenderer("chatcmpl-1", "m", created=123)
    role = chunk(r.role())
    assert role.choices[0].delta.role == "assistant"
    text = chunk(
        r.render(
            TextDelta(
                "héllo",
                logprobs=[{"token": "h", "logprob": -0.1, "bytes": [104], "top_logprobs": []}],
            )
        )
    )
    assert text.id == "chatcmpl-1" and text.model == "m" and text.created == 123
    assert text.choices[0].delta.content == "héllo"
    tool = chunk(r.render(ToolCallDelta(0, '{"a"', id="call_1", name="f")))
    call = tool.choices[0].delta.tool_calls[0]
    assert (call.id, call.type, call.function.name, call.function.arguments) == (
        "call_1",
        "function",
        "f",
        '{"a"',
    )
    done = chunk(r.render(Finish("length", index=1)))
    assert (done.choices[0].index, done.choices[0].finish_reason) == (1, "length")
    usage = chunk(r.usage(Usage(3, 4)))
    assert usage.choices == [] and usage.usage.total_tokens == 7
    assert r.render(Usage(1, 1)) is None


def test_completion_builder_joins_choices_and_tool_calls():
    b = CompletionBuilder(2)
    for event in [
        TextDelta("Hel", 0),
        TextDelta("a", 1),
        TextDelta("lo", 0),
        ToolCallDelta(0, '{"x":', id="c1", name="f", index=1),
        ToolCallDelta(0, "1}", index=1),
        Finish("stop", 0),
        Finish("tool_calls", 1),
        Usage(5, 6),
    ]:
        b.add(event)
    completion = ChatCompletion.model_validate_json(b.build("chatcmpl-2", "m", 1))
    first, second = completion.choices
    assert first.message.content == "Hello" and first.finish_reason == "stop"
    assert second.message.tool_calls[0].function.arguments == '{"x":1}'
    assert second.finish_reason == "tool_calls"
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens == 6


def test_a_stop_string_is_vllms_stop_reason_in_the_chunk_the_object_and_back():
    r = ChunkRenderer("chatcmpl-1", "m", created=1)
    finish = Finish("stop", stop_string="\n\n")
    raw = r.render(finish)
    assert orjson.loads(raw)["choices"][0]["stop_reason"] == "\n\n"
    assert chunk_events(orjson.loads(raw)) == [finish]
    assert "stop_reason" not in orjson.loads(r.render(Finish("stop")))["choices"][0]
    builder = CompletionBuilder(1)
    for event in (TextDelta("a"), finish, Usage(2, 1)):
        builder.add(event)
    completion = builder.build("chatcmpl-1", "m", 1)
    assert orjson.loads(completion)["choices"][0]["stop_reason"] == "\n\n"
    ChatCompletion.model_validate_json(completion)
    replayed = [orjson.loads(c) for c in completion_chunks(completion)]
    assert replayed[-1]["choices"][0]["stop_reason"] == "\n\n"


def test_an_upstreams_stop_token_id_is_no_stop_string():
    choice = {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": 128009}
    assert chunk_events({"choices": [choice]}) == [Finish("stop")]
    choice = {**choice, "finish_reason": "length", "stop_reason": "x"}
    assert chunk_events({"choices": [choice]}) == [Finish("length")]
