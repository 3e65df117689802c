"""A run's events as Anthropic's Messages stream and object (gateway/anthropic/render.py),
each event checked against the `anthropic` SDK's own types."""

from __future__ import annotations

import orjson
import pydantic
from anthropic.types import Message, RawMessageStreamEvent

from adapters.events import Accepted, ErrorEvent, Finish, TextDelta, ToolCallDelta, Usage
from adapters.requests import ChatRequest
from gateway.anthropic.render import MessageRenderer, message_object
from gateway.anthropic.stream import AnthropicFraming, MessageFrames, framed
from gateway.runs.pipeline import RunPipeline
from gateway.runs.status import RunStatus
from gateway.runs.tool_calls import tool_call_stage
from gateway.state.run_store import RunRecord, TerminalRecord

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


# -- through a run's log: what the pipeline writes, as a Messages stream reads it back ---------


async def logged(events: list, *, usage_on_open: int | None = 9, stages=()) -> tuple:
    """The log a Messages run's pipeline writes for `events`, and its terminal record."""
    pipeline = RunPipeline("msg_1", "m", 1, 1, stages, usage_on_open=usage_on_open)
    chunks, _ = await pipeline.feed(events)
    held, _ = await pipeline.finish()
    log = [(seq, *c) for seq, c in enumerate(chunks + held, 1)]
    finish = next(e.reason for e in events if type(e) is Finish)
    return log, completed(finish, pipeline.completion(1))


def streamed(log: list, terminal: TerminalRecord, first: int = 0) -> list[dict]:
    """A Messages stream of the log: its first read holding `first` events, then the rest."""
    frames = MessageFrames(RunRecord("msg_1", "t", "m", 1.0))
    out = frames.first(log[:first]) + frames.batch(log[first:], False) + frames.ending(terminal)
    events = [orjson.loads(frame.split(b"data: ", 1)[1]) for _, frame, _, _ in out]
    for event in events:
        if event["type"] != "ping":
            EVENT.validate_python(event)
    return events


STOPPED = [
    Accepted(prompt_tokens=11),
    TextDelta("Once upon"),
    Finish("stop", stop_string=" a time"),
    Usage(11, 3),
]


async def test_a_stop_sequence_is_named_in_the_stream_and_the_message():
    log, terminal = await logged(STOPPED)
    events = streamed(log, terminal)
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " a time"}
    message = message_object("msg_1", terminal.completion_object())
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", " a time")


async def test_a_stop_without_a_named_string_is_the_end_of_the_turn():
    log, terminal = await logged([TextDelta("Hi"), Finish("stop"), Usage(4, 1)])
    delta = next(e for e in streamed(log, terminal) if e["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


async def test_a_tool_call_stage_passes_a_finish_and_its_stop_string_as_they_came():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    stage = tool_call_stage(ChatRequest("m", [], tools=tools))
    _, terminal = await logged(STOPPED, stages=[stage])
    message = message_object("msg_1", terminal.completion_object())
    assert message["stop_sequence"] == " a time"


async def test_message_start_waits_for_the_runs_opening_and_carries_its_prompt_tokens():
    log, terminal = await logged(STOPPED)
    frames = MessageFrames(RunRecord("msg_1", "t", "m", 1.0))
    assert frames.first([]) == []  # a queued run: only the writer's pings until it opens
    events = streamed(log, terminal)
    assert events[0]["type"] == "message_start"
    assert events[0]["message"]["usage"] == {"input_tokens": 11, "output_tokens": 0}
    assert events[-2]["usage"] == {"input_tokens": 11, "output_tokens": 3}


async def test_without_the_upstreams_count_message_start_has_the_estimate():
    log, terminal = await logged([TextDelta("Hi"), Finish("stop"), Usage(4, 1)], usage_on_open=9)
    start = streamed(log, terminal)[0]
    assert start["message"]["usage"]["input_tokens"] == 9


async def test_a_replay_of_the_log_renders_the_same_stream():
    log, terminal = await logged(STOPPED)
    live = streamed(log, terminal, first=2)
    assert streamed(log, terminal) == live
    assert streamed(log, terminal, first=len(log)) == live


async def test_a_chat_runs_role_chunk_carries_no_usage():
    log, _ = await logged(STOPPED, usage_on_open=None)
    assert b"usage" not in log[0][1]
