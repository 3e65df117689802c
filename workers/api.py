"""The worker API (docs/worker-api.md), defined once for both ends: the `/v1/generate` body, the
NDJSON lines of its stream, and the error body.

The worker server parses bodies and serialises lines with it; the engine produces the line
types as its typed outputs; the gateway's worker adapter builds bodies and reads lines with it.
Torch-free, so the gateway imports it without any model code. Parsing is strict about types (a
bool is not an int) and names the offending field; unknown fields are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from workers.limits import ROLES
from workers.output_spec import ResponseFormat, ToolSpec, parse_response_format, parse_tools
from workers.sampling_params import InvalidParam, SamplingParams

# 2: response_format, tools and tool_choice in the body, tool-call fields on messages, the
# `tool_call` line and the `tool_calls` finish reason. A version-1 worker would ignore those
# fields silently, so the gateway refuses to talk to one.
# 3: `ids` on `text` and `tool_call` lines, `continuation` in the body (a run another worker
# started, continued from its exact token). A version-2 worker would ignore `continuation` and
# generate the text again from the start. (`shared_system_prompt` needed no new version: a worker
# that ignores it only shares less.)
API_VERSION = 3
MAX_REQUEST_ID_LEN = 256
# Far above any context length: the model's own limit is the worker's check (Engine.check_fits);
# this one only bounds the parsing.
MAX_CONTINUATION = 1 << 20
_MISSING = object()


class BadRequest(Exception):
    """A 400 before the stream starts; `param` names the field."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class GenerateBody:
    """A parsed `/v1/generate` body: the id, the chat messages and the sampling parameters."""

    request_id: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    response_format: ResponseFormat | None = None
    tools: ToolSpec | None = None
    cache_salt: str | None = None  # prefix-cache isolation (the gateway sets one per tenant)
    continuation: tuple[int, ...] = ()  # choice 0's tokens another worker already streamed
    shared_system_prompt: bool = False  # the first message may be cached for every salt


def error_body(
    message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
) -> dict[str, Any]:
    """OpenAI's error shape; `code` is always a string."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _field(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name, _MISSING)
    return default if value is _MISSING or value is None else value


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = _field(body, name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{name} must be an integer", name, "invalid_type")
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number", name, "invalid_type")
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be finite", name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = _field(body, name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", name, "invalid_type")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = _field(body, "stop", [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop must be a string or a list of strings", "stop", "invalid_type")
    return tuple(value)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    value = _field(body, "stop_token_ids", [])
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise BadRequest(
            "stop_token_ids must be a list of integers", "stop_token_ids", "invalid_type"
        )
    return tuple(value)


def _continuation(body: dict[str, Any], n: int) -> tuple[int, ...]:
    """Token ids another worker generated for choice 0 and the client already received."""
    value = _field(body, "continuation", [])
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise BadRequest(
            "continuation must be a list of token ids (integers >= 0)",
            "continuation",
            "invalid_type",
        )
    if len(value) > MAX_CONTINUATION:
        raise BadRequest(f"continuation has at most {MAX_CONTINUATION} ids", "continuation")
    if value and n != 1:
        raise BadRequest("continuation requires n = 1", "continuation")
    return tuple(value)


def _tool_calls(i: int, value: Any) -> list[dict[str, Any]]:
    """An assistant message's calls, as OpenAI writes them (arguments a JSON string)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list", "messages", "invalid_type")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{where} items need a function with a name", "messages")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise BadRequest(f"{where} arguments must be a JSON string", "messages")
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{i}] must be an object", "messages", "invalid_type")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {sorted(ROLES)}", "messages")
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(i, message["tool_calls"])
        out["content"] = content = content or ""
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string", "messages", "invalid_type")
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"messages[{i}].{key} must be a string", "messages", "invalid_type")
        if value is not None:
            out[key] = value
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages: role and string content, and on tool turns `tool_calls` (assistant),
    `tool_call_id` and `name` (tool)."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list", "messages", "invalid_type")
    return [_message(i, m) for i, m in enumerate(value)]


def _request_id(body: dict[str, Any]) -> str:
    value = body.get("request_id")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_LEN:
        raise BadRequest(
            f"request_id must be a string of 1 to {MAX_REQUEST_ID_LEN} characters",
            "request_id",
            "invalid_type",
        )
    return value


def parse_generate(body: Any) -> GenerateBody:
    """Validate a decoded JSON body; raises BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None, "invalid_type")
    request_id, messages = _request_id(body), _messages(body)
    try:
        params = SamplingParams(
            max_tokens=_int(body, "max_tokens", None),
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0),
            seed=_int(body, "seed", None),
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body),
            n=_int(body, "n", 1),
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            logprobs=_bool(body, "logprobs", False),
            top_logprobs=_int(body, "top_logprobs", 0),
            ignore_eos=_bool(body, "ignore_eos", False),
        )
        response_format = parse_response_format(body.get("response_format"))
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except InvalidParam as e:
        raise BadRequest(str(e), e.param) from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= 256):
        raise BadRequest("cache_salt must be a string of 1 to 256 characters", "cache_salt")
    continuation = _continuation(body, params.n)
    shared = _bool(body, "shared_system_prompt", False)
    return GenerateBody(
        request_id, messages, params, response_format, tools, salt, continuation, shared
    )


# -- the request body ------------------------------------------------------------------------


@dataclass(slots=True)
class GenerateRequest:
    """A `/v1/generate` body as the client (the gateway's adapter) builds it: the parameters
    are the engine's own `SamplingParams`, so both ends validate them alike."""

    request_id: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    response_format: ResponseFormat | None = None
    tools: ToolSpec | None = None
    cache_salt: str | None = None
    continuation: list[int] | None = None  # choice 0's ids a dead worker already streamed
    shared_system_prompt: bool = False  # the gateway's word: the first message is declared shared

    def to_json(self) -> bytes:
        p = self.params
        extra: dict[str, Any] = {}
        if self.cache_salt is not None:
            extra["cache_salt"] = self.cache_salt
        if self.shared_system_prompt:
            extra["shared_system_prompt"] = True
        if self.continuation is not None:
            extra["continuation"] = self.continuation
        if self.response_format is not None:
            extra["response_format"] = self.response_format.wire()
        if self.tools is not None:
            extra["tools"] = [t.wire() for t in self.tools.tools]
            extra["tool_choice"] = self.tools.wire_choice()
        return orjson.dumps(
            {
                "request_id": self.request_id,
                "messages": self.messages,
                "max_tokens": p.max_tokens,
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k,
                "seed": p.seed,
                "stop": list(p.stop),
                "stop_token_ids": list(p.stop_token_ids),
                "n": p.n,
                "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty,
                "logprobs": p.logprobs,
                "top_logprobs": p.top_logprobs,
                "ignore_eos": p.ignore_eos,
                **extra,
            }
        )


# -- the stream's lines ---------------------------------------------------------------------


@dataclass(slots=True)
class StartLine:
    """First, once the prompt is tokenized (the request was accepted into the queue)."""

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
    """Released text of one choice; `tokens` is how many generated tokens it carries and `ids`
    are those tokens (what a `continuation` resubmits)."""

    index: int
    text: str
    tokens: int
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's `content` list, when asked for
    ids: list[int] = field(default_factory=list)  # len(ids) == tokens
    type: str = "text"

    def wire(self) -> dict[str, Any]:
        out = {
            "type": "text",
            "index": self.index,
            "text": self.text,
            "tokens": self.tokens,
            "ids": self.ids,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


@dataclass(slots=True)
class ToolCallLine:
    """One whole tool call the model made in choice `index` (`call_index` counts its calls);
    `arguments` is a JSON string, `tokens` the generated tokens its markup took, `ids` those
    tokens."""

    index: int
    call_index: int
    name: str
    arguments: str
    tokens: int
    ids: list[int] = field(default_factory=list)  # len(ids) == tokens
    type: str = "tool_call"

    def wire(self) -> dict[str, Any]:
        return {
            "type": "tool_call",
            "index": self.index,
            "call_index": self.call_index,
            "name": self.name,
            "arguments": self.arguments,
            "tokens": self.tokens,
            "ids": self.ids,
        }


@dataclass(slots=True)
class FinishLine:
    """A choice is done. With reason `abort`, also what the abort cost: tokens generated after
    it arrived and the time from its arrival to the step boundary where the sequence stopped."""

    index: int
    reason: str  # stop | length | tool_calls | abort
    completion_tokens: int
    tail_tokens: int | None = None
    stop_latency_ms: float | None = None
    type: str = "finish"

    def wire(self) -> dict[str, Any]:
        out = {
            "type": "finish",
            "index": self.index,
            "reason": self.reason,
            "completion_tokens": self.completion_tokens,
        }
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


Line = StartLine | AdmittedLine | TextLine | ToolCallLine | FinishLine | UsageLine | ErrorLine
_LINES: dict[str, type] = {
    "start": StartLine,
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
        index, "abort", completion_tokens, tail_tokens, round(stop_latency_s * 1000, 3)
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
    try:
        return kind(**record)
    except TypeError:  # fields a newer worker added: read what this version knows
        known = kind.__dataclass_fields__
        return kind(**{k: v for k, v in record.items() if k in known})
