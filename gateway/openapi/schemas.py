"""The schemas of the OpenAPI document (gateway/openapi/document.py): the request as the parser
takes it (gateway/protocol.py, wire/limits.py), the objects and stream events the gateway answers
with, and the error body."""

from __future__ import annotations

from typing import Any

from gateway.model_endpoints import ENDPOINTS
from gateway.protocol import BOUNDS, RESPONSE_FORMATS, SERVICE_TIERS, TOOL_CHOICES
from wire.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, ROLES
from wire.share import TIERS

_REF = "#/components/schemas/"
SERVICE_TIER = {
    "enum": [*SERVICE_TIERS, None],
    "description": "auto (or null): the key's default tier; a tier the key may not use is a 400. "
    "priority goes ahead of default; flex is sheddable batch work (design §12).",
}
STREAM_TEXT = (
    "Server-sent events: `id: <seq>` and `data: <chat.completion.chunk>` frames, "
    "`: ping` comments while idle, an `error` frame on a failure, then `data: [DONE]`."
)


def ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def bounded(name: str, **more: Any) -> dict[str, Any]:
    """A numeric field as the parser bounds it (gateway/protocol.py's BOUNDS), or null."""
    b = BOUNDS[name]
    low = {"exclusiveMinimum": b.low} if b.low_open else {"minimum": b.low}
    kind = "integer" if b.integer else "number"
    return {"type": [kind, "null"], **low, "maximum": b.high, **more}


def _nullable(kind: str, **more: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], **more}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


def _function_object(function: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """OpenAI's `{"type": "function", "function": {…}}` wrapper (tools, tool calls, choices)."""
    return _object(["type", "function", *required], type={"const": "function"}, function=function)


def _message() -> dict[str, Any]:
    """One message, as the parser takes it: by role (a tool turn names its call, only an
    assistant turn carries calls, and its content may then be null)."""
    text_part = _object(["type", "text"], type={"const": "text"}, text={"type": "string"})
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    call = _object(["name", "arguments"], name={"type": "string"}, arguments={"type": "string"})
    tool_call = _object(["id", "function"], id={"type": "string"}, type={"const": "function"})
    tool_call["properties"]["function"] = call
    common = {"name": _nullable("string"), "tool_call_id": _nullable("string")}
    no_calls = {"type": "null"}

    def role(*names: str, required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["role", *required],
            "properties": {"role": {"enum": list(names)}, **common, **properties},
        }

    assistant_calls = {"type": "array", "minItems": 1, "items": tool_call}
    return {
        "oneOf": [
            role(
                *sorted(ROLES - {"assistant", "tool"}),
                required=("content",),
                content=content,
                tool_calls=no_calls,
            ),
            role(
                "assistant",
                required=("content",),
                content=content,
                tool_calls={"anyOf": [assistant_calls, {"type": "null"}]},
            ),
            role(
                "assistant",
                required=("tool_calls",),
                content={"type": "null"},
                tool_calls=assistant_calls,
            ),
            role(
                "tool",
                required=("content", "tool_call_id"),
                content=content,
                tool_call_id={"type": "string"},
                tool_calls=no_calls,
            ),
        ]
    }


def _parameters() -> dict[str, Any]:
    """A tool's `parameters`: any JSON Schema (draft 2020-12 or 7) is taken; the document
    spells out the common object form, which is all a generated request needs."""
    return {
        "type": "object",
        "description": "A JSON Schema (draft 2020-12 or 7) for the call's arguments.",
        "properties": {
            "type": {"const": "object"},
            "properties": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "properties": {"type": {"enum": ["string", "number", "integer", "boolean"]}},
                    "additionalProperties": False,
                },
            },
            "required": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        },
        "additionalProperties": False,
    }


def _tool() -> dict[str, Any]:
    function = _object(
        ["name"],
        name={"type": "string", "minLength": 1},
        description={"type": "string"},
        parameters=_parameters(),
        strict={"type": ["boolean", "null"]},
    )
    return _function_object(function)


def _needs(field: str, when: dict[str, Any], flag: str) -> dict[str, Any]:
    """`field` (when it is `when`) is allowed only with `flag` true."""
    return {
        "if": {"required": [field], "properties": {field: when}},
        "then": {"required": [flag], "properties": {flag: {"const": True}}},
    }


def _sampling_properties() -> dict[str, Any]:
    """The request's fields that shape the sampling, with the parser's ranges."""
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    stops = {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": stop_string}
    return {
        "max_tokens": bounded("max_tokens"),
        "max_completion_tokens": bounded("max_completion_tokens"),
        "temperature": bounded("temperature"),
        "top_p": bounded("top_p"),
        "seed": bounded("seed"),
        "stop": {"anyOf": [stop_string, stops, {"type": "null"}]},
        "n": bounded("n"),
        "logprobs": _nullable("boolean"),
        "top_logprobs": bounded("top_logprobs", description="Needs `logprobs`."),
        "presence_penalty": bounded("presence_penalty"),
        "frequency_penalty": bounded("frequency_penalty"),
    }


def _chat_request() -> dict[str, Any]:
    named_choice = _function_object(_object(["name"], name={"type": "string", "minLength": 1}))
    only_with = [
        _needs("stream_options", {"type": "object"}, "stream"),
        _needs("top_logprobs", {"type": "integer", "minimum": 1}, "logprobs"),
    ]
    return {
        "type": "object",
        "required": ["model", "messages"],
        "description": "OpenAI's Chat Completions request; unknown fields are ignored.",
        "allOf": only_with,
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
            "stream": _nullable("boolean"),
            "stream_options": {
                "type": ["object", "null"],
                "description": "Only with `stream: true`.",
                "properties": {"include_usage": _nullable("boolean")},
            },
            **_sampling_properties(),
            "tools": {"type": ["array", "null"], "items": ref("Tool")},
            "tool_choice": {
                "anyOf": [{"enum": sorted(TOOL_CHOICES)}, named_choice, {"type": "null"}]
            },
            "response_format": {
                "type": ["object", "null"],
                "required": ["type"],
                "properties": {
                    "type": {"enum": sorted(RESPONSE_FORMATS)},
                    "json_schema": {"type": "object"},
                },
            },
            "user": _nullable("string"),
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            "service_tier": SERVICE_TIER,
        },
    }


def _chat_completion() -> dict[str, Any]:
    choice = {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {"type": "object"},
            "finish_reason": {
                "enum": ["stop", "length", "content_filter", "tool_calls", None],
                "description": "null for a choice that never finished (its run ended early).",
            },
            "stop_reason": {
                "type": "string",
                "description": "The request's stop string that ended the choice (vLLM's "
                "field); present only where the backend said which one matched. Its final "
                "chunk in a stream carries it too.",
            },
            "logprobs": {"type": ["object", "null"]},
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "service_tier": {"enum": list(TIERS), "description": "The tier that served it."},
            "choices": {"type": "array", "items": choice},
            "usage": {"type": ["object", "null"]},
            "status": {
                "enum": ["queued", "in_progress", "completed", "cancelled", "timed_out", "failed"],
                "description": "The run's status (on a retrieved run).",
            },
            "follow_token": {
                "type": "string",
                "description": "A token that reads this run by `?token=` (on a retrieved run).",
            },
        },
    }


def _wire_schemas() -> dict[str, Any]:
    """The error body, the stream's events and the model objects."""
    nullable_string = {"type": ["string", "null"]}
    error = _object(
        ["message", "type", "param", "code"],
        message={"type": "string"},
        type={"type": "string"},
        param=nullable_string,
        code=nullable_string,
    )
    data = {
        "type": "string",
        "description": "A `chat.completion.chunk` or an `error` object as JSON, or `[DONE]`.",
    }
    model = _object(
        ["id", "object", "created", "owned_by"],
        id={"type": "string"},
        object={"const": "model"},
        created={"type": "integer"},
        owned_by={"type": "string"},
        max_model_len={"type": "integer"},
        endpoints={
            "type": "array",
            "items": {"type": "string", "enum": list(ENDPOINTS)},
            "description": "The routes that serve this model (a sluicegate extension).",
        },
    )
    models = _object(
        ["object", "data"], object={"const": "list"}, data={"type": "array", "items": ref("Model")}
    )
    event = _object(
        ["data"],
        id={"type": "string", "pattern": "^[0-9]+$"},
        event={"const": "message"},
        data=data,
    )
    event["description"] = STREAM_TEXT
    return {
        "ErrorResponse": _object(["error"], error=error),
        "StreamEvent": event,
        "Model": model,
        "ModelList": models,
    }


def components() -> dict[str, Any]:
    return {
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "An API key (`sk-sluice-…`) or a JWT of a known tenant.",
            }
        },
        "headers": {
            "RetryAfter": {
                "description": "Seconds to wait before retrying.",
                "schema": {"type": "string", "pattern": "^[0-9]+$"},
            }
        },
        "schemas": {
            **_wire_schemas(),
            "ChatMessage": _message(),
            "Tool": _tool(),
            "ChatCompletionRequest": _chat_request(),
            "ChatCompletion": _chat_completion(),
        },
    }
