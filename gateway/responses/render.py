"""The second renderer of a run: its events as OpenAI's Responses typed events.

A response is a run like any chat completion; its log holds the same chunks, read back as the
run's events (adapters/chat_chunks.py, the one module that knows the chunk's shape). This
renderer takes them in order and says what they are in the Responses protocol:
`response.created` and `response.in_progress` first, then per output item its `added` events, its
deltas and its `done` events, and, once the run has ended, the terminal event with the whole
response object.

NOTE: the typed events are a pure function of the log and the run's ending, numbered from 0 in
the order they are produced. A resume after `sequence_number` N renders the log again from its
start and sends what comes after N: numbers agree on every replica and every read, none is
missing or repeated, with nothing more kept than the run's own log.
"""

from __future__ import annotations

from typing import Any

import orjson

from adapters.events import Event, Finish, TextDelta, ToolCallDelta
from gateway.responses.request import ResponseParams
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from gateway.state.run_store import TerminalRecord

INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.cancelled",
    "failed": "response.failed",
}


def response_status(status: RunStatus, finish_reason: str | None) -> str:
    """A run's status as a response's: a length or content-filter finish is `incomplete`, a
    timeout `failed` (its error says `timeout`)."""
    if status is RunStatus.COMPLETED and finish_reason in INCOMPLETE:
        return "incomplete"
    public = PUBLIC_STATUS[status]
    return "failed" if public == "timed_out" else public


def usage_object(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseRenderer:
    """Renders one run's log chunks, in order, as numbered Responses events (dicts)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: float,
        params: ResponseParams,
        service_tier: str | None = None,
    ):
        """`service_tier`: the tier serving the run (design §12), echoed by the object."""
        self.response_id = response_id
        self.service_tier = service_tier
        self.model = model
        self.created = int(created)
        self.params = params
        self.suffix = response_id.removeprefix("resp_")
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the output item still being written
        # NOTE: the open message's text as its deltas came, joined only when it is shown (its
        # done events, a response snapshot): appending to one string copies it every time
        self.pieces: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # by the call's index
        self.index_of: dict[str, int] = {}  # output index by item id
        self.finish_reason: str | None = None
        self.sequence = 0

    # -- events --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response("queued")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    def feed(self, events: list[Event]) -> list[dict[str, Any]]:
        """The typed events of a run's events (none for usage or an error)."""
        out: list[dict[str, Any]] = []
        for event in events:
            kind = type(event)
            if kind is TextDelta:
                out += self._text(event.text)
            elif kind is ToolCallDelta:
                out += self._call(event)
            elif kind is Finish:
                self.finish_reason = event.reason
                out += self._close("completed")
        return out

    def ending(self, terminal: TerminalRecord) -> list[dict[str, Any]]:
        """The events that end the stream of a run that ended so."""
        status = response_status(terminal.status, terminal.finish_reason)
        events = self._close("completed" if status == "completed" else "incomplete")
        final = self.response(status, terminal)
        return [*events, self._event(TERMINAL_EVENTS[status], response=final)]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self.open
        if item is None or item["type"] != "message":
            events += self._close("completed")
            self.pieces = []
            item = self.open = {
                "id": f"msg_{self.suffix}_{len(self.output)}",
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            index = self.index_of[item["id"]] = len(self.output)
            self.output.append(item)
            events.append(
                self._event("response.output_item.added", output_index=index, item=_copy(item))
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self._event("response.content_part.added", **self._at(item), part=_copy(part))
            )
        self.pieces.append(text)
        events.append(
            self._event("response.output_text.delta", **self._at(item), delta=text, logprobs=[])
        )
        return events

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self.calls.get(call.call_index)
        if item is None:
            events += self._close("completed")
            item = self.open = self.calls[call.call_index] = {
                "id": f"fc_{self.suffix}_{len(self.output)}",
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id or "",
                "name": call.name or "",
                "arguments": "",
            }
            index = self.index_of[item["id"]] = len(self.output)
            self.output.append(item)
            events.append(
                self._event("response.output_item.added", output_index=index, item=_copy(item))
            )
        if call.arguments:
            item["arguments"] += call.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.index_of[item["id"]],
                    delta=call.arguments,
                )
            )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The `done` events of the item being written, if any."""
        self._join()
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.index_of[item["id"]]
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = item["content"][0]
            where = self._at(item)
            events.append(
                self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
            )
            events.append(self._event("response.content_part.done", **where, part=_copy(part)))
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=index, item=_copy(item))
        )
        return events

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {
            "item_id": item["id"],
            "output_index": self.index_of[item["id"]],
            "content_index": 0,
        }

    # -- the object ----------------------------------------------------------------------------

    def _join(self) -> None:
        """The open message's text, joined from its pieces."""
        if self.open is not None and self.open["type"] == "message":
            self.open["content"][0]["text"] = "".join(self.pieces)

    def response(self, status: str, terminal: TerminalRecord | None = None) -> dict[str, Any]:
        """The response object as it stands: `status`, the output so far; with the run's
        `terminal` record, its error, usage and completion time."""
        self._join()
        p = self.params
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": p.background,
            "error": None,
            "incomplete_details": None,
            "instructions": p.instructions,
            "max_output_tokens": p.max_output_tokens,
            "metadata": p.metadata,
            "model": self.model,
            "output": _copy(self.output),
            "parallel_tool_calls": True,
            "previous_response_id": p.previous_response_id,
            "service_tier": self.service_tier,
            "store": p.store,
            "temperature": p.temperature,
            "text": p.text,
            "tool_choice": p.tool_choice,
            "tools": p.tools,
            "top_p": p.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": p.user,
        }
        if terminal is not None:
            completion = terminal.completion_object() or {}
            body["model"] = completion.get("model", self.model)  # a model alias's target
            body["usage"] = usage_object(completion.get("usage"))
            if status == "incomplete":
                body["incomplete_details"] = {"reason": INCOMPLETE[terminal.finish_reason]}
            elif status == "completed":
                body["completed_at"] = int(terminal.at)
            if terminal.error is not None and status != "completed":
                body["error"] = {
                    "code": terminal.error["code"],
                    "message": terminal.error["message"],
                }
        return body


def _copy(value: Any) -> Any:
    """A snapshot: events keep the item as it was, the renderer goes on writing its own."""
    return orjson.loads(orjson.dumps(value))
