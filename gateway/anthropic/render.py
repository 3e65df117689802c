"""A run's events as Anthropic's Messages events, and its final chat completion as a message.

A Messages request is a run like any chat completion; its log holds the same chunks, read back
as the run's events (adapters/chat_chunks.py). This renderer says what they are in Anthropic's
protocol: `message_start`; per content block its `content_block_start`, its deltas
(`text_delta`, `input_json_delta`) and its `content_block_stop`; a `ping` after the first
block opens; then, once the run has ended, `message_delta` (the stop reason and usage) and
`message_stop`, or an `error` event for a run that did not complete.
"""

from __future__ import annotations

from typing import Any

import orjson

from adapters.events import ErrorEvent, Event, Finish, TextDelta, ToolCallDelta
from gateway.anthropic.errors import stream_error
from gateway.runs.status import RunStatus
from gateway.state.run_store import TerminalRecord

# NOTE: a stop string's finish is `stop` like the end of the turn: the run does not say which
# string matched, so `stop_sequence` is never reported (docs/anthropic.md)
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def stop_reason(finish_reason: str | None) -> str:
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


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
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": None,
        "usage": usage_of(completion),
    }


class MessageRenderer:
    """Renders one run's log events, in order, as Anthropic stream events (dicts)."""

    __slots__ = ("_calls", "_index", "_open", "_pinged", "finish_reason", "message_id", "model")

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._index = -1  # the content block being written (or last written)
        self._open: str | None = None  # its kind: "text", "tool_use", or None when closed
        self._calls: dict[int, int] = {}  # a tool call's index → its content block
        self._pinged = False
        self.finish_reason: str | None = None

    def opening(self) -> list[dict[str, Any]]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}]

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        """The stream events of a run's events (none for usage: it comes with the ending)."""
        out: list[dict[str, Any]] = []
        for event in events:
            kind = type(event)
            if kind is TextDelta:
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif kind is ToolCallDelta:
                out += self._call(event)
            elif kind is Finish:
                self.finish_reason = event.reason
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
        reason = stop_reason(terminal.finish_reason or self.finish_reason)
        delta = {"stop_reason": reason, "stop_sequence": None}
        events.append({"type": "message_delta", "delta": delta, "usage": usage_of(completion)})
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
