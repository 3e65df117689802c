"""Events → chunk and completion objects, checked against the openai SDK's own types."""

from __future__ import annotations

import orjson
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from adapters.chat_chunks import ChunkRenderer, CompletionBuilder
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
