"""The worker API (docs/worker-api.md), defined once for both ends: the version, the NDJSON
lines of the `/v1/generate` stream, and the error body (the body itself is
wire/generate_body.py).

The worker server serialises lines with it; the engine produces the line types as its typed
outputs; the gateway's worker adapter reads lines with it. Torch-free, so the gateway imports it
without any model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

# 2: response_format, tools and tool_choice in the body, tool-call fields on messages, the
# `tool_call` line and the `tool_calls` finish reason. A version-1 worker would ignore those
# fields silently, so the gateway refuses to talk to one.
# 3: `ids` on `text` and `tool_call` lines, `continuation` in the body (a run another worker
# started, continued from its exact token). A version-2 worker would ignore `continuation` and
# generate the text again from the start. (`shared_system_prompt` needed no new version: a worker
# that ignores it only shares less.)
# 4: `continue_final_message` in the body (the last, assistant, message is continued rather than
# answered: a run another OpenAI-compatible member started, continued from its text). A
# version-3 worker would ignore it and begin a new assistant turn.
# 5: `prompt` (a string) in place of `messages` (exactly one of them): raw text, tokenized as it
# is with no chat template (a legacy completion's). A version-4 worker would refuse the body
# for its missing `messages`.
# 6: `POST /v1/embed` (unit vectors of texts, the model's final hidden state mean-pooled). A
# version-5 worker answers it 404, so the gateway refuses one rather than fail each embedding.
# (`stop_string` on `finish` lines and `POST /v1/count` needed no new version: a gateway that
# ignores the field only reports less, and a worker without the route answers it 404, which the
# gateway takes as "count by estimate".)
API_VERSION = 6


class BadRequest(Exception):
    """A 400 before the stream starts; `param` names the field."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def error_body(
    message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
) -> dict[str, Any]:
    """OpenAI's error shape; `code` is always a string."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- the stream's lines ---------------------------------------------------------------------


@dataclass(slots=True)
class AcceptedLine:
    """First, once the prompt is tokenized (the request was accepted into the queue); the
    gateway's `Accepted`. On the wire its type is `start`."""

    prompt_tokens: int
    type: str = "start"

    def wire(self) -> dict[str, Any]:
        return {"type": "start", "prompt_tokens": self.prompt_tokens}


@dataclass(slots=True)
class AdmittedLine:
    """Once per request, when the engine first schedules it: it has left the queue."""

    type: str = "admitted"

    def wire(self) -> dict[str, Any]:
        return {"type": "admitted"}


@dataclass(slots=True)
class TextLine:
    """Released text of one choice (the gateway's `TextDelta`); `tokens` is how many generated
    tokens it carries and `token_ids` are those tokens (what a `continuation` resubmits; `ids`
    on the wire)."""

    text: str
    index: int
    tokens: int
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's `content` list, when asked for
    token_ids: list[int] = field(default_factory=list)  # len(token_ids) == tokens
    type: str = "text"

    def wire(self) -> dict[str, Any]:
        out = {
            "type": "text",
            "index": self.index,
            "text": self.text,
            "tokens": self.tokens,
            "ids": self.token_ids,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


@dataclass(slots=True)
class ToolCallLine:
    """One whole tool call the model made in choice `index` (`call_index` counts its calls; the
    gateway's `ToolCallDelta`, whole); `arguments` is a JSON string, `tokens` the generated tokens
    its markup took, `token_ids` those tokens (`ids` on the wire)."""

    call_index: int
    arguments: str
    name: str
    index: int
    tokens: int
    token_ids: list[int] = field(default_factory=list)  # len(token_ids) == tokens
    type: str = "tool_call"

    def wire(self) -> dict[str, Any]:
        return {
            "type": "tool_call",
            "index": self.index,
            "call_index": self.call_index,
            "name": self.name,
            "arguments": self.arguments,
            "tokens": self.tokens,
            "ids": self.token_ids,
        }


@dataclass(slots=True)
class FinishLine:
    """A choice is done. With reason `abort`, also what the abort cost: tokens generated after
    it arrived and the time from its arrival to the step boundary where the sequence stopped
    (the gateway's `Finish`, or its `Aborted`). `stop_string`: the request's stop string that
    ended the choice (reason `stop`), absent otherwise."""

    reason: str  # stop | length | tool_calls | abort
    index: int
    completion_tokens: int
    tail_tokens: int | None = None
    stop_latency_ms: float | None = None
    stop_string: str | None = None
    type: str = "finish"

    def wire(self) -> dict[str, Any]:
        out = {
            "type": "finish",
            "index": self.index,
            "reason": self.reason,
            "completion_tokens": self.completion_tokens,
        }
        if self.stop_string is not None:
            out["stop_string"] = self.stop_string
        if self.reason == "abort":
            out["tail_tokens"] = self.tail_tokens
            out["stop_latency_ms"] = self.stop_latency_ms
        return out


@dataclass(slots=True)
class UsageLine:
    """Last line of a normal stream (completion tokens summed over choices)."""

    prompt_tokens: int
    completion_tokens: int
    type: str = "usage"

    def wire(self) -> dict[str, Any]:
        out = {"type": "usage", "prompt_tokens": self.prompt_tokens}
        return out | {"completion_tokens": self.completion_tokens}


@dataclass(slots=True)
class ErrorLine:
    """The engine failed this request; last line."""

    code: str
    message: str
    type: str = "error"

    def wire(self) -> dict[str, Any]:
        return {"type": "error", "code": self.code, "message": self.message}


Line = AcceptedLine | AdmittedLine | TextLine | ToolCallLine | FinishLine | UsageLine | ErrorLine
_LINES: dict[str, type] = {
    "start": AcceptedLine,
    "admitted": AdmittedLine,
    "text": TextLine,
    "tool_call": ToolCallLine,
    "finish": FinishLine,
    "usage": UsageLine,
    "error": ErrorLine,
}


def abort_line(
    index: int, completion_tokens: int, tail_tokens: int, stop_latency_s: float
) -> FinishLine:
    return FinishLine(
        "abort", index, completion_tokens, tail_tokens, round(stop_latency_s * 1000, 3)
    )


def encode(line: Line) -> bytes:
    """One NDJSON line (optional fields only where they apply, as docs/worker-api.md says)."""
    return orjson.dumps(line.wire()) + b"\n"


def decode(raw: bytes) -> Line | None:
    """One line read back; None for a line type this version does not know (skipped)."""
    record = orjson.loads(raw)
    kind = _LINES.get(record.pop("type", None))
    if kind is None:
        return None
    if "ids" in record:  # the wire's short name for token_ids
        record["token_ids"] = record.pop("ids")
    try:
        return kind(**record)
    except TypeError:  # fields a newer worker added: read what this version knows
        known = kind.__dataclass_fields__
        return kind(**{k: v for k, v in record.items() if k in known})
