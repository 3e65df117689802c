"""A run's events as Anthropic's Messages events, and its final chat completion as a message.

A Messages request is a run like any chat completion; its log holds the same chunks, read back
as the run's events (adapters/chat_chunks.py). This renderer says what they are in Anthropic's
protocol: `message_start` (with the prompt's tokens, which the run's first role chunk carries: see
gateway/runs/pipeline.py); per content block its `content_block_start`, its deltas
(`text_delta`, `input_json_delta`) and its `content_block_stop`; a `ping` after the first
block opens; then, once the run has ended, `message_delta` (the stop reason, the stop sequence
that matched, and usage) and `message_stop`, or an `error` event for a run that did not complete.
"""

from __future__ import annotations

from typing import Any

import orjson

from adapters.chat_chunks import stop_string_of
from adapters.events import ErrorEvent, Event, Finish, TextDelta, ToolCallDelta, Usage
from gateway.anthropic.errors import stream_error
from gateway.runs.status import RunStatus
from gateway.state.run_store import TerminalRecord

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def stop_fields(finish_reason: str | None, stop_string: str | None = None) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` of a choice that finished so. NOTE: a finish `stop`
    is a stop sequence only where the backend said which string matched (our workers, vLLM);
    otherwise it reads as the end of the turn (docs/runs/anthropic-messages.md)."""
    reason = finish_reason or "stop"
    if reason == "stop" and stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": STOP_REASONS.get(reason, "end_turn"), "stop_sequence": None}


def usage_of(completion: dict[str, Any] | None) -> dict[str, int]:
    usage = (completion or {}).get("usage") or {}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
    }


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the `tool_use` block's input (an object, as Anthropic's is)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_object(message_id: str, completion: dict[str, Any]) -> dict[str, Any]:
    """The `message` a completed run's chat completion is."""
    choice = (completion.get("choices") or [{}])[0]
    reply = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": _input(function.get("arguments", "")),
            }
        )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": completion.get("model", ""),
        **stop_fields(choice.get("finish_reason"), stop_string_of(choice)),
        "usage": usage_of(completion),
    }


class MessageRenderer:
    """Renders one run's log events, in order, as Anthropic stream events (dicts)."""

    __slots__ = (
        "_calls",
        "_index",
        "_open",
        "_pinged",
        "finish",
        "message_id",
        "model",
        "started",
    )

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._index = -1  # the content block being written (or last written)
        self._open: str | None = None  # its kind: "text", "tool_use", or None when closed
        self._calls: dict[int, int] = {}  # a tool call's index → its content block
        self._pinged = False
        self.started = False  # message_start is out
        self.finish: Finish | None = None

    def opening(self, input_tokens: int = 0) -> list[dict[str, Any]]:
        """`message_start`, once; `input_tokens`: the prompt's, as the run's opening says."""
        self.started = True
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}]

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        """The stream events of one log chunk's events: `message_start` first, from the run's
        opening chunk (its usage is the prompt's); later usage comes with the ending."""
        out: list[dict[str, Any]] = []
        if not self.started:
            usage = next((e for e in events if type(e) is Usage), None)
            out += self.opening(usage.prompt_tokens if usage is not None else 0)
        for event in events:
            kind = type(event)
            if kind is TextDelta:
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif kind is ToolCallDelta:
                out += self._call(event)
            elif kind is Finish:
                self.finish = event
                out += self._stop()
            elif kind is ErrorEvent:
                pass  # the run ends failed: its ending says so, once
        return out

    def ending(self, terminal: TerminalRecord) -> list[dict[str, Any]]:
        """The events that end the stream of a run that ended so."""
        events = self._stop()
        if terminal.status is not RunStatus.COMPLETED:
            error = terminal.error or {"message": "The run did not complete."}
            return [*events, stream_error(error)]
        completion = terminal.completion_object()
        usage = usage_of(completion)
        if not self.started:  # a log read from its start always opens; this is a safeguard
            events = self.opening(usage["input_tokens"]) + events
        choice = ((completion or {}).get("choices") or [{}])[0]
        finish = self.finish
        reason = terminal.finish_reason or (finish.reason if finish else None)
        stop_string = stop_string_of(choice) or (finish.stop_string if finish else None)
        delta = stop_fields(reason, stop_string)
        events.append({"type": "message_delta", "delta": delta, "usage": usage})
        events.append({"type": "message_stop"})
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self._index += 1
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": self._index, "content_block": block})
        if not self._pinged:  # as Anthropic's own streams do, once the first block opens
            self._pinged = True
            events.append({"type": "ping"})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.call_index not in self._calls:
            block = {"type": "tool_use", "id": call.id or "", "name": call.name or "", "input": {}}
            events += self._start(block)
            self._calls[call.call_index] = self._index
        if call.arguments:
            # NOTE: a call's fragments arrive in order, one call at a time (our workers send a
            # call whole; the pipeline releases it only whole and valid)
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def _stop(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]
