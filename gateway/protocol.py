"""The OpenAI Chat Completions request schema: parsing and validation in one place.

`parse_chat_request` turns a decoded JSON body into a `ChatRequest` or raises an `APIError` whose
message and `param` name the offending field. Unknown fields are ignored, as OpenAI does. The
ranges and choices it enforces (BOUNDS, the sets below, wire/limits.py) are what the OpenAPI
document (gateway/openapi/schemas.py) states: both read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.requests import ChatRequest, Message
from gateway.http.errors import invalid_request
from gateway.runs.tool_calls import check_tool_parameters
from wire.limits import (
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    ROLES,
    shown,
)
from wire.share import TIERS

TOOL_CHOICES = frozenset({"none", "auto", "required"})
RESPONSE_FORMATS = frozenset({"text", "json_object", "json_schema"})
MAX_INT64 = 2**63 - 1  # what a body can carry on to a backend
SERVICE_TIERS = ("auto", *TIERS)


@dataclass(frozen=True, slots=True)
class Bounds:
    """A numeric field's range; `low_open`: the low end itself is refused."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False


BOUNDS = {
    "max_completion_tokens": Bounds(1, MAX_INT64, integer=True),
    "max_tokens": Bounds(1, MAX_INT64, integer=True),
    "temperature": Bounds(0.0, 2.0),
    "top_p": Bounds(0.0, 1.0, low_open=True),
    "seed": Bounds(-(2**63), MAX_INT64, integer=True),
    "n": Bounds(1, MAX_N, integer=True),
    "top_logprobs": Bounds(0, MAX_TOP_LOGPROBS, integer=True),
    "presence_penalty": Bounds(-2.0, 2.0),
    "frequency_penalty": Bounds(-2.0, 2.0),
}


def _type_name(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _quoted(value: Any) -> str:
    """A request's value as an error message may repeat it: a string quoted and cut short,
    anything else by its JSON type alone."""
    return shown(value) if isinstance(value, str) else _type_name(value)


def _expect(body: dict[str, Any], name: str, kinds: tuple[type, ...], label: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass in Python, but not a number in JSON Schema.
    is_bool_as_number = isinstance(value, bool) and bool not in kinds
    if is_bool_as_number or not isinstance(value, kinds):
        raise invalid_request(
            name,
            f"Invalid type for '{name}': expected {label}, but got {_type_name(value)}.",
            code="invalid_type",
        )
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False):
    value = _expect(body, name, (int, float), "a number")
    if value is None:
        return None
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise invalid_request(
            name,
            f"Invalid value for '{name}': {value} is outside the range {bracket}{low}, {high}].",
        )
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)  # JSON's 1e3 and 8.0 are integers too
    else:
        value = _expect(body, name, (int,), "an integer")
    if value is None:
        return None
    if value < low or (high is not None and value > high):
        # NOTE: a bound that only keeps a number within what a backend can carry is not news
        limit = f"at least {low}" if high in (None, MAX_INT64) else f"between {low} and {high}"
        raise invalid_request(name, f"Invalid value for '{name}': {value}; it must be {limit}.")
    return value


def _bounded(body: dict[str, Any], name: str) -> Any:
    """The field `name` within its BOUNDS, or None when absent."""
    b = BOUNDS[name]
    if b.integer:
        return _integer(body, name, int(b.low), int(b.high))
    return _number(body, name, b.low, b.high, low_open=b.low_open)


def _parse_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(
            where,
            f"Invalid type for '{where}': expected a string or an array of content parts.",
            code="invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = _quoted(part.get("type")) if isinstance(part, dict) else repr(_type_name(part))
            raise invalid_request(
                f"{where}[{j}].type",
                f"Unsupported content part type {kind} in '{where}[{j}]': only 'text' parts are "
                "supported.",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_request(
                f"{where}[{j}].text", f"'{where}[{j}].text' must be a string.", code="invalid_type"
            )
        texts.append(text)
    return "".join(texts)


def _parse_message(i: int, raw: Any) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise invalid_request(where, f"'{where}' must be an object.", code="invalid_type")
    role = raw.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid_request(
            f"{where}.role",
            f"Invalid value for '{where}.role': {_quoted(role)}. Supported roles are "
            "'system', 'developer', 'user', 'assistant' and 'tool'.",
        )
    content = _parse_content(raw.get("content"), f"{where}.content")
    tool_calls = raw.get("tool_calls")
    if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
        raise invalid_request(
            f"{where}.tool_calls", f"'{where}.tool_calls' must be an array on an assistant message."
        )
    if content is None and not tool_calls:
        raise invalid_request(
            f"{where}.content",
            f"Missing required parameter: '{where}.content'.",
            code="missing_required_parameter",
        )
    if tool_calls:
        _check_tool_calls(f"{where}.tool_calls", tool_calls)
    name = raw.get("name")
    tool_call_id = raw.get("tool_call_id")
    for key, value in (("name", name), ("tool_call_id", tool_call_id)):
        if value is not None and not isinstance(value, str):
            raise invalid_request(f"{where}.{key}", f"'{where}.{key}' must be a string.")
    if role == "tool" and tool_call_id is None:
        raise invalid_request(
            f"{where}.tool_call_id",
            f"Missing required parameter: '{where}.tool_call_id'.",
            code="missing_required_parameter",
        )
    return Message(role, content, name, tool_call_id, tool_calls)


def _check_tool_calls(where: str, calls: list[Any]) -> None:
    """An assistant turn's calls, as OpenAI shapes them: each goes back to the backend as is."""
    for k, call in enumerate(calls):
        here = f"{where}[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise invalid_request(
                here, f"'{here}' must be an object with type 'function' and a 'function' object."
            )
        for key, field in ((call, "id"), (fn, "name"), (fn, "arguments")):
            if not isinstance(key.get(field), str):
                name = f"{here}.id" if field == "id" else f"{here}.function.{field}"
                raise invalid_request(name, f"'{name}' must be a string.")


def _parse_messages(body: dict[str, Any]) -> list[Message]:
    raw = body.get("messages")
    if raw is None:
        raise invalid_request(
            "messages", "Missing required parameter: 'messages'.", code="missing_required_parameter"
        )
    if not isinstance(raw, list):
        raise invalid_request(
            "messages",
            f"Invalid type for 'messages': expected an array, but got {_type_name(raw)}.",
            code="invalid_type",
        )
    if not raw:
        raise invalid_request(
            "messages",
            "Invalid 'messages': empty array. Expected an array with at least 1 message.",
            code="empty_array",
        )
    return [_parse_message(i, m) for i, m in enumerate(raw)]


def _parse_stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid_request(
            "stop",
            "Invalid type for 'stop': expected a string or an array of strings.",
            code="invalid_type",
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid_request(
            "stop",
            f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop sequences are allowed, "
            f"got {len(stop)}.",
        )
    if any(s == "" for s in stop):
        raise invalid_request("stop", "Invalid 'stop': stop sequences must not be empty.")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise invalid_request(
            "stop", f"Invalid 'stop': a stop sequence may have at most {MAX_STOP_CHARS} characters."
        )
    return stop


def _parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = _expect(body, "tools", (list,), "an array")
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise invalid_request(
                f"tools[{i}]",
                f"'tools[{i}]' must be an object with type 'function' and a 'function' object.",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid_request(
                f"tools[{i}].function.name",
                f"Missing required parameter: 'tools[{i}].function.name'.",
                code="missing_required_parameter",
            )
    check_tool_parameters(tools)
    return tools


def _parse_tool_choice(body: dict[str, Any]) -> str | dict[str, Any] | None:
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            return choice
        raise invalid_request(
            "tool_choice.function.name",
            "Missing required parameter: 'tool_choice.function.name'.",
            code="missing_required_parameter",
        )
    raise invalid_request(
        "tool_choice",
        "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}.",
    )


def _parse_response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = _expect(body, "response_format", (dict,), "an object")
    kind = None if fmt is None else fmt.get("type")
    if fmt is not None and (not isinstance(kind, str) or kind not in RESPONSE_FORMATS):
        raise invalid_request(
            "response_format.type",
            "Invalid 'response_format.type': expected 'text', 'json_object' or 'json_schema'.",
        )
    return fmt


def _parse_metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = _expect(body, "metadata", (dict,), "an object")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise invalid_request("metadata", "Invalid 'metadata': values must be strings.")
    return metadata


def _parse_service_tier(body: dict[str, Any]) -> str | None:
    tier = _expect(body, "service_tier", (str,), "a string")
    if tier is not None and tier not in SERVICE_TIERS:
        raise invalid_request(
            "service_tier",
            f"Invalid value for 'service_tier': {_quoted(tier)}. Supported values are 'auto', "
            "'default', 'flex' and 'priority'.",
        )
    return tier


def _parse_continue_final(body: dict[str, Any], messages: list[Message]) -> bool:
    """vLLM's and SGLang's extension: `continue_final_message: true` (with
    `add_generation_prompt` false or absent) continues the last message, the assistant's."""
    continue_final = bool(_expect(body, "continue_final_message", (bool,), "a boolean"))
    generation_prompt = _expect(body, "add_generation_prompt", (bool,), "a boolean")
    if continue_final and generation_prompt:
        raise invalid_request(
            "add_generation_prompt",
            "'add_generation_prompt' must be false with 'continue_final_message'.",
        )
    if generation_prompt is False and not continue_final:
        raise invalid_request(
            "add_generation_prompt",
            "'add_generation_prompt: false' is supported only with 'continue_final_message'.",
        )
    last = messages[-1]
    if continue_final and (last.role != "assistant" or last.content is None or last.tool_calls):
        raise invalid_request(
            "continue_final_message",
            "'continue_final_message' needs the last message to be the assistant's, with text.",
        )
    return continue_final


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise `APIError` naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The request body must be a JSON object.", code="invalid_type")
    model = _expect(body, "model", (str,), "a string")
    if not model:
        raise invalid_request(
            "model", "Missing required parameter: 'model'.", code="missing_required_parameter"
        )
    messages = _parse_messages(body)
    stream = bool(_expect(body, "stream", (bool,), "a boolean"))
    options = _expect(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise invalid_request(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
        )
    include_usage = bool(_expect(options or {}, "include_usage", (bool,), "a boolean"))
    max_tokens = _bounded(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _bounded(body, "max_tokens")
    logprobs = bool(_expect(body, "logprobs", (bool,), "a boolean"))
    top_logprobs = _bounded(body, "top_logprobs") or 0
    if top_logprobs and not logprobs:
        raise invalid_request("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    temperature = _bounded(body, "temperature")
    top_p = _bounded(body, "top_p")
    presence = _bounded(body, "presence_penalty")
    frequency = _bounded(body, "frequency_penalty")
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=_bounded(body, "seed"),
        stop=_parse_stop(body),
        n=_bounded(body, "n") or 1,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=presence or 0.0,
        frequency_penalty=frequency or 0.0,
        tools=_parse_tools(body),
        tool_choice=_parse_tool_choice(body),
        response_format=_parse_response_format(body),
        user=_expect(body, "user", (str,), "a string"),
        metadata=_parse_metadata(body),
        service_tier=_parse_service_tier(body),
        continue_final_message=_parse_continue_final(body, messages),
    )
