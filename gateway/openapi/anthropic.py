"""The Anthropic Messages part of the OpenAPI document (gateway/openapi/document.py): its routes
and schemas, as gateway/anthropic/request.py checks a request (unknown fields refused, known ones
sluicegate cannot honour allowed only when null or neutral) and as the handlers answer, errors
in Anthropic's shape and with its status codes (529 for overloaded)."""

from __future__ import annotations

from typing import Any

from gateway.anthropic.count import COUNT_SOURCE_HEADER
from gateway.anthropic.errors import OVERLOADED, error_body
from gateway.anthropic.request import REFUSED
from gateway.openapi.document import IDEMPOTENCY_PARAM, JSON, SSE, _answer
from gateway.openapi.schemas import _object, _parameters, bounded, ref
from gateway.protocol import MAX_INT64
from wire.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS

EVENTS_TEXT = (
    "Server-sent events with `event:` lines, as Anthropic streams them: `message_start`, per "
    "content block `content_block_start`, `content_block_delta` (`text_delta`, "
    "`input_json_delta`) and `content_block_stop`, a `ping`, then `message_delta` (stop reason, "
    "usage) and `message_stop`; a run that fails ends with an `error` event. No `[DONE]`."
)
_ERROR_TEXT = {
    400: "A malformed body, a bad value or a field sluicegate cannot honour (named first).",
    401: "No valid key in `x-api-key` or `Authorization: Bearer`.",
    403: "The key's tenant may not use this model.",
    404: "No such model.",
    408: "The request body did not arrive within the body timeout.",
    410: "The run this `Idempotency-Key` started is no longer kept.",
    413: "The request body is larger than the gateway accepts.",
    415: "The body is not `application/json`.",
    422: "The `Idempotency-Key` was used before with another body.",
    429: "A rate limit, the concurrency limit or the token budget of the tenant was reached.",
    499: "The run was cancelled before it completed.",
    502: "The model backend failed.",
    504: "A deadline of the run passed.",
    OVERLOADED: "Overloaded: no backend can take the request now, the state store is "
    "unreachable, or the gateway is draining.",
}
_RETRY = {429, OVERLOADED}
_TEXT = {"type": "string"}
_NAME = {"type": "string", "minLength": 1}


def _errors(*statuses: int) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    for status in statuses:
        answer: dict[str, Any] = {
            "description": _ERROR_TEXT[status],
            "content": {JSON: {"schema": ref("AnthropicError")}},
        }
        if status in _RETRY:
            answer["headers"] = {"retry-after": {"$ref": "#/components/headers/RetryAfter"}}
        answers[str(status)] = answer
    return answers


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    return _object(required, **properties) | {"additionalProperties": False}


def _blocks() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(a text block, a tool_use block, a tool_result block)."""
    text = _closed(["type", "text"], type={"const": "text"}, text=_TEXT)
    texts = {"anyOf": [_TEXT, {"type": "array", "items": text}]}
    use = _closed(
        ["type", "id", "name", "input"],
        type={"const": "tool_use"},
        id=_TEXT,
        name=_TEXT,
        input={"type": "object"},
    )
    result = _closed(
        ["type", "tool_use_id"],
        type={"const": "tool_result"},
        tool_use_id=_TEXT,
        content=texts,
        is_error={"type": ["boolean", "null"]},
    )
    return text, use, result


def _messages() -> dict[str, Any]:
    text, use, result = _blocks()

    def turn(role: str, *blocks: dict[str, Any]) -> dict[str, Any]:
        content = {"anyOf": [_TEXT, {"type": "array", "items": {"anyOf": list(blocks)}}]}
        return _closed(["role", "content"], role={"const": role}, content=content)

    return {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [turn("user", text, result), turn("assistant", text, use)]},
    }


def _tools() -> tuple[dict[str, Any], dict[str, Any]]:
    """(`tools`, `tool_choice`)."""
    tool = _closed(
        ["name", "input_schema"],
        type={"enum": ["custom", None]},
        name=_NAME,
        description=_TEXT,
        input_schema=_parameters(),
    )
    parallel = {"enum": [False, None]}
    choice = _closed(
        ["type"], type={"enum": ["auto", "any", "none"]}, disable_parallel_tool_use=parallel
    )
    named = _closed(
        ["type", "name"], type={"const": "tool"}, name=_NAME, disable_parallel_tool_use=parallel
    )
    tools = {"type": ["array", "null"], "items": tool}
    return tools, {"anyOf": [choice, named, {"type": "null"}]}


def _request(count: bool = False) -> dict[str, Any]:
    text, _, _ = _blocks()
    tools, tool_choice = _tools()
    properties: dict[str, Any] = {
        "model": _NAME,
        "messages": _messages(),
        "system": {"anyOf": [_TEXT, {"type": "array", "items": text}, {"type": "null"}]},
        "tools": tools,
        "tool_choice": tool_choice,
    }
    if count:
        return _closed(["model", "messages"], **properties)
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    refused = {name: {"enum": [None, neutral]} for name, neutral in REFUSED.items()}
    properties |= {
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_INT64},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "top_p": bounded("top_p"),
        "top_k": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_INT64},
        "stop_sequences": {
            "type": ["array", "null"],
            "maxItems": MAX_STOP_STRINGS,
            "items": stop,
        },
        "stream": {"type": ["boolean", "null"]},
        "metadata": {
            "type": ["object", "null"],
            "properties": {"user_id": {"type": ["string", "null"]}},
            "additionalProperties": False,
        },
        **refused,
    }
    schema = _closed(["model", "messages", "max_tokens"], **properties)
    schema["description"] = (
        "Anthropic's Messages request. Unknown fields are refused (400); fields sluicegate "
        "cannot honour are allowed only when null or neutral (docs/anthropic.md)."
    )
    return schema


def _schemas() -> dict[str, Any]:
    usage = _object(
        ["input_tokens", "output_tokens"],
        input_tokens={"type": "integer"},
        output_tokens={"type": "integer"},
    )
    message = _object(
        ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"],
        id={"type": "string"},
        type={"const": "message"},
        role={"const": "assistant"},
        content={"type": "array", "items": _object(["type"], type={"enum": ["text", "tool_use"]})},
        model={"type": "string"},
        stop_reason={"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]},
        stop_sequence={"type": ["string", "null"]},
        usage=usage,
    )
    kinds = sorted({error_body(s, "")["error"]["type"] for s in (*_ERROR_TEXT, 500)})
    error = _object(
        ["type", "error"],
        type={"const": "error"},
        error=_object(["type", "message"], type={"enum": kinds}, message={"type": "string"}),
    )
    event = _object(["event", "data"], event={"type": "string"}, data={"type": "string"})
    event["description"] = EVENTS_TEXT
    return {
        "MessagesRequest": _request(),
        "MessageCountRequest": _request(count=True),
        "AnthropicMessage": message,
        "AnthropicStreamEvent": event,
        "AnthropicError": error,
        "MessageTokensCount": _object(["input_tokens"], input_tokens={"type": "integer"}),
    }


_SECURITY = [{"bearer": []}, {"x-api-key": []}]
_HEADERS = [
    {
        "name": "anthropic-version",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "Accepted and not checked: the API here is the one this document shows.",
    }
]


def _paths() -> dict[str, Any]:
    either = {
        JSON: {"schema": ref("AnthropicMessage")},
        SSE: {"schema": ref("AnthropicStreamEvent")},
    }
    create = {
        "operationId": "createMessage",
        "summary": "Start a run; answer its message whole, or stream its events (`stream`).",
        "security": _SECURITY,
        "parameters": [*_HEADERS, IDEMPOTENCY_PARAM],
        "requestBody": {"required": True, "content": {JSON: {"schema": ref("MessagesRequest")}}},
        "responses": {
            "200": _answer("The message.", either),
            **_errors(400, 401, 403, 404, 408, 410, 413, 415, 422, 429, 499, 502, 504, OVERLOADED),
        },
    }
    source = {
        COUNT_SOURCE_HEADER: {
            "description": "Who counted: `worker`, a sluice worker with the model's own "
            "tokenizer and chat template (equal to a create's `input_tokens`); `upstream`, an "
            "OpenAI-compatible upstream's own `/tokenize`; `estimate`, the gateway's own "
            "count (high by design) where the backend cannot count.",
            "schema": {"enum": ["worker", "upstream", "estimate"]},
        }
    }
    count = {
        "operationId": "countMessageTokens",
        "summary": "The prompt tokens a Messages request would use.",
        "security": _SECURITY,
        "parameters": _HEADERS,
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": ref("MessageCountRequest")}},
        },
        "responses": {
            "200": _answer("The count.", {JSON: {"schema": ref("MessageTokensCount")}}, source),
            **_errors(400, 401, 403, 404, 408, 413, 415, OVERLOADED),
        },
    }
    return {"/v1/messages": {"post": create}, "/v1/messages/count_tokens": {"post": count}}


def with_anthropic(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the Messages routes, their schemas and the `x-api-key` scheme."""
    document["paths"].update(_paths())
    components = document["components"]
    components["schemas"].update(_schemas())
    components["securitySchemes"]["x-api-key"] = {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "An API key, as Anthropic's clients send it (Messages routes only).",
    }
    return document
