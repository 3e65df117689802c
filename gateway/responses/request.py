"""The OpenAI Responses request schema, as a chat request on the same runs.

A Responses body is checked for its own fields here (`input`, `instructions`, `text.format`,
`background`, `store`, …) and rewritten as the chat body it asks for, which then goes through
the one chat parser (gateway/protocol.py): one set of checks for sampling, tools and schemas.
An error that parser raises names a chat field; `renamed` gives it back the Responses name.
A known field sluicegate cannot honour is a 400 naming it; an unknown field is a 400 too, as
OpenAI's Responses API answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.field_check import check_fields
from gateway.http.errors import APIError, invalid_request
from gateway.protocol import TOOL_CHOICES
from gateway.responses.items import input_messages
from wire.limits import shown

HONOURED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "background",
        "store",
        "previous_response_id",
        "tools",
        "tool_choice",
        "text",
        "metadata",
        "user",
        "parallel_tool_calls",
        "service_tier",
    }
)
# Known Responses fields with no meaning here: refused unless null (or their neutral value).
REFUSED = {
    "conversation": None,
    "prompt": None,
    "reasoning": None,
    "include": [],
    "truncation": "disabled",
    "max_tool_calls": None,
    "top_logprobs": None,
    "prompt_cache_key": None,
    "prompt_cache_retention": None,
    "safety_identifier": None,
    "stream_options": None,
}
TEXT_FORMATS = frozenset({"text", "json_object", "json_schema"})

# chat field → Responses field, for errors the chat parser and the backend checks raise
_RENAMES = (
    (re.compile(r"\bmax_completion_tokens\b|\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format(\.type)?\b"), "text.format"),
    (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"\bmessages\b"), "input"),
)


@dataclass(slots=True)
class ResponseParams:
    """What a response keeps beside its run (the run record's meta): echoed in its object,
    listed by `input_items`, continued by a `previous_response_id`."""

    background: bool = False
    store: bool = True
    stream: bool = False
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    input_items: list[dict[str, Any]] = field(default_factory=list)
    conversation: list[dict[str, Any]] = field(default_factory=list)  # chat messages, no system

    def to_meta(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ResponseParams:
        return cls(**{k: v for k, v in meta.items() if k in cls.__slots__})


def renamed(exc: APIError) -> APIError:
    """The error with the Responses names of the fields it names."""
    for pattern, name in _RENAMES:
        if exc.param is not None:
            exc.param = pattern.sub(name, exc.param)
        exc.message = pattern.sub(name, exc.message)
    return exc


def _check_fields(body: dict[str, Any]) -> None:
    check_fields(body, HONOURED, REFUSED, lambda name: f"Unknown parameter: {name}.")
    if body.get("parallel_tool_calls") is False:
        raise invalid_request(
            "parallel_tool_calls",
            "'parallel_tool_calls' false is not supported: a model here may call several tools.",
            code="unsupported_parameter",
        )


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(name, f"'{name}' must be a boolean.", code="invalid_type")
    return value


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid_request(name, f"'{name}' must be a string.", code="invalid_type")
    return value


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_request("tools", "'tools' must be an array.", code="invalid_type")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = _shown_type(tool)
            raise invalid_request(
                f"tools[{i}].type",
                f"Unsupported tool type {kind} in 'tools[{i}]': only 'function' tools are "
                "supported.",
                code="unsupported_parameter",
            )
    return raw


def _shown_type(raw: Any) -> str:
    kind = raw.get("type") if isinstance(raw, dict) else None
    return shown(kind) if isinstance(kind, str) else "none"


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    """`none`, `auto`, `required` or `{"type": "function", "name": …}` (checked here: the chat
    form with a `function` object is not the Responses one)."""
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "name": name}
        raise invalid_request(
            "tool_choice.name",
            "Missing required parameter: 'tool_choice.name'.",
            code="missing_required_parameter",
        )
    raise invalid_request(
        "tool_choice",
        "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
        "{'type': 'function', 'name': ...}.",
    )


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(raw: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the `text` object as echoed, the chat `response_format` it asks for)."""
    if raw is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(raw, dict):
        raise invalid_request("text", "'text' must be an object.", code="invalid_type")
    for key, value in raw.items():
        if key not in ("format", "verbosity") or (
            key == "verbosity" and value not in (None, "medium")
        ):
            raise invalid_request(
                f"text.{key}", f"'text.{key}' is not supported.", code="unsupported_parameter"
            )
    fmt = raw.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str) or kind not in TEXT_FORMATS:
        raise invalid_request(
            "text.format.type",
            "Invalid 'text.format.type': expected 'text', 'json_object' or 'json_schema'.",
        )
    if kind != "json_schema":
        return {"format": {"type": kind}}, {"type": kind}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"format": fmt}, {"type": "json_schema", "json_schema": schema}


def response_params(body: Any) -> ResponseParams:
    """The Responses fields of a body, checked; raises an APIError naming the first bad one."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The request body must be a JSON object.", code="invalid_type")
    _check_fields(body)
    params = ResponseParams(
        background=_flag(body, "background", False),
        store=_flag(body, "store", True),
        stream=_flag(body, "stream", False),
        instructions=_string(body, "instructions"),
        previous_response_id=_string(body, "previous_response_id"),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        user=_string(body, "user"),
    )
    if params.background and not params.store:
        raise invalid_request(
            "background", "A background response must be stored: 'store' cannot be false."
        )
    params.text, _ = _text_format(body.get("text"))
    return params


def chat_body(body: dict[str, Any], params: ResponseParams, history: list[dict]) -> dict:
    """The chat body a checked Responses body asks for; `history` is the conversation its
    `previous_response_id` continues (chat messages, oldest first). Sets the params' input
    items and the echoed fields the chat parser will have checked."""
    messages, params.input_items = input_messages(body.get("input"))
    params.conversation = history + messages
    system = [{"role": "system", "content": params.instructions}] if params.instructions else []
    _, response_format = _text_format(body.get("text"))
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": system + params.conversation,
        "stream": params.stream,
    }
    optional = {
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "user": params.user,
        "metadata": body.get("metadata"),
        "response_format": response_format,
        "service_tier": body.get("service_tier"),
    }
    if params.tools:
        optional["tools"] = [_chat_tool(t) for t in params.tools]
    if body.get("tool_choice") is not None:
        optional["tool_choice"] = _chat_tool_choice(params.tool_choice)
    chat.update({k: v for k, v in optional.items() if v is not None})
    return chat
