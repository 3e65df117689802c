"""A run's events as Anthropic's Messages stream and object (gateway/anthropic/render.py),
each event checked against the `anthropic` SDK's own types."""

from __future__ import annotations

import orjson
import pydantic
from anthropic.types import Message, RawMessageStreamEvent

from adapters.events import ErrorEvent, Finish, TextDelta, ToolCallDelta, Usage
from gateway.anthropic.render import MessageRenderer, message_object
from gateway.anthropic.stream import AnthropicFraming, framed
from gateway.runs.status import RunStatus
from gateway.state.run_store import TerminalRecord

EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


def completion(content: str | None, calls: list | None = None, finish: str = "stop") -> bytes:
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "served",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        }
    )


def completed(finish: str, body: bytes) -> TerminalRecord:
    return TerminalRecord(RunStatus.COMPLETED, "finished", finish, body)


def rendered(events: list, terminal: TerminalRecord) -> list[dict]:
    renderer = MessageRenderer("msg_1", "m")
    out = renderer.opening() + renderer.feed(events) + renderer.ending(terminal)
    for event in out:
        if event["type"] not in ("ping", "error"):
            EVENT.validate_python(event)
    return out


def test_text_stream_in_anthropics_order():
    events = [TextDelta("Hel"), TextDelta("lo"), Finish("stop"), Usage(7, 3)]
    out = rendered(events, completed("stop", completion("Hello")))
    assert [e["type"] for e in out] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert out[0]["message"]["id"] == "msg_1"
    assert [e["delta"] for e in out[3:5]] == [
        {"type": "text_delta", "text": "Hel"},
        {"type": "text_delta", "text": "lo"},
    ]
    assert out[6]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert out[6]["usage"] == {"input_tokens": 7, "output_tokens": 3}


def test_tool_call_is_a_tool_use_block_with_json_deltas():
    events = [
        TextDelta("Let me look."),
        ToolCallDelta(0, "", "call_1", "weather"),
        ToolCallDelta(0, '{"city":'),
        ToolCallDelta(0, '"Paris"}'),
        Finish("tool_calls"),
    ]
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
        }
    ]
    out = rendered(events, completed("tool_calls", completion("Let me look.", calls)))
    starts = [e for e in out if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1]
    assert starts[1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "weather",
        "input": {},
    }
    deltas = [e["delta"] for e in out if e["type"] == "content_block_delta" and e["index"] == 1]
    assert "".join(d["partial_json"] for d in deltas) == '{"city":"Paris"}'
    assert [e["index"] for e in out if e["type"] == "content_block_stop"] == [0, 1]
    assert out[-2]["delta"]["stop_reason"] == "tool_use"


def test_length_finish_is_max_tokens():
    out = rendered([TextDelta("a"), Finish("length")], completed("length", completion("a")))
    assert out[-2]["delta"]["stop_reason"] == "max_tokens"


def test_a_failed_run_ends_with_an_error_event_and_no_message_stop():
    terminal = TerminalRecord(
        RunStatus.FAILED,
        "upstream",
        error={"message": "The upstream failed.", "type": "server_error", "code": "upstream_error"},
    )
    out = rendered([TextDelta("a"), ErrorEvent("upstream_error", "x")], terminal)
    assert [e["type"] for e in out][-2:] == ["content_block_stop", "error"]
    assert out[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "The upstream failed."},
    }


def test_frames_name_their_event_and_the_stream_has_no_done():
    frames = framed([{"type": "message_stop"}])
    assert frames[0][1] == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    framing = AnthropicFraming()
    assert framing.done == b""
    overloaded = {"message": "busy", "type": "server_error", "code": "overloaded"}
    assert framing.error(overloaded) == (
        b'event: error\ndata: {"type":"error","error":'
        b'{"type":"overloaded_error","message":"busy"}}\n\n'
    )


def test_message_object_from_the_final_completion():
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    message = message_object("msg_1", orjson.loads(completion("Hi", calls, "tool_calls")))
    Message.model_validate(message)
    assert message == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Hi"},
            {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
        ],
        "model": "served",
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 3},
    }
