"""The Responses API's part of the OpenAPI document (gateway/openapi/document.py): its routes and
schemas, as gateway/responses/request.py checks a request (unknown fields refused, known ones
sluicegate cannot honour allowed only when null or neutral) and as the handlers answer."""

from __future__ import annotations

from typing import Any

from gateway.openapi.document import (
    _RUN_ID,
    FOLLOW_TOKEN_HEADER,
    FOLLOW_TOKEN_PARAM,
    JSON,
    NOTHING_AFTER,
    SSE,
    _answer,
    _errors,
    _get,
)
from gateway.openapi.schemas import (
    SERVICE_TIER,
    _nullable,
    _object,
    _parameters,
    bounded,
    ref,
)
from gateway.protocol import TOOL_CHOICES
from gateway.responses.items import ROLES, TEXT_PARTS
from gateway.responses.request import REFUSED
from wire.share import TIERS

STATUSES = ["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
EVENTS_TEXT = (
    "Server-sent events: `id: <sequence_number>` and `data: <typed event>` frames (`type` "
    "`response.created`, `response.output_text.delta`, …, `response.completed`), `: ping` "
    "comments while idle, then `data: [DONE]`."
)


def _input_item() -> dict[str, Any]:
    part = _object(["type", "text"], type={"enum": sorted(TEXT_PARTS)}, text={"type": "string"})
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    message = _object(
        ["role", "content"],
        type={"const": "message"},
        role={"enum": sorted(ROLES)},
        content=content,
    )
    name = {"type": "string", "minLength": 1}
    call = _object(
        ["type", "call_id", "name", "arguments"],
        type={"const": "function_call"},
        call_id=name,
        name=name,
        arguments={"type": "string"},
    )
    output = _object(
        ["type", "call_id", "output"],
        type={"const": "function_call_output"},
        call_id=name,
        output={"type": "string"},
    )
    return {"anyOf": [message, call, output]}


def _request() -> dict[str, Any]:
    tool = _object(
        ["type", "name"],
        type={"const": "function"},
        name={"type": "string", "minLength": 1},
        description={"type": "string"},
        parameters=_parameters(),
        strict=_nullable("boolean"),
    )
    named = _object(
        ["type", "name"], type={"const": "function"}, name={"type": "string", "minLength": 1}
    )
    text_format = _object(["type"], type={"enum": ["json_object", "json_schema", "text"]})
    text = {
        "type": ["object", "null"],
        "properties": {
            "format": {"anyOf": [text_format, {"type": "null"}]},
            "verbosity": {"enum": ["medium", None]},
        },
        "additionalProperties": False,
    }
    refused = {name: {"enum": [None, neutral]} for name, neutral in REFUSED.items()}
    return {
        "type": "object",
        "required": ["model", "input"],
        "description": "OpenAI's Responses request. Unknown fields are refused (400); fields "
        "sluicegate cannot honour are allowed only when null or neutral.",
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": _input_item()},
                ]
            },
            "instructions": _nullable("string"),
            "max_output_tokens": bounded("max_completion_tokens"),
            "temperature": bounded("temperature"),
            "top_p": bounded("top_p"),
            "stream": _nullable("boolean"),
            "background": _nullable("boolean", description="Needs `store` (not false)."),
            "store": _nullable("boolean"),
            "previous_response_id": _nullable("string"),
            "tools": {"type": ["array", "null"], "items": tool},
            "tool_choice": {"anyOf": [{"enum": sorted(TOOL_CHOICES)}, named, {"type": "null"}]},
            "text": text,
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            "user": _nullable("string"),
            "parallel_tool_calls": {"enum": [True, None]},
            "service_tier": SERVICE_TIER,
            **refused,
        },
        "additionalProperties": False,
        "allOf": [
            {
                "if": {"required": ["background"], "properties": {"background": {"const": True}}},
                "then": {"properties": {"store": {"enum": [True, None]}}},
            }
        ],
    }


def _schemas() -> dict[str, Any]:
    response = _object(
        ["id", "object", "created_at", "status", "model", "output"],
        id={"type": "string"},
        object={"const": "response"},
        created_at={"type": "integer"},
        status={"enum": STATUSES},
        model={"type": "string"},
        service_tier={"enum": [*TIERS, None]},
        output={"type": "array", "items": {"type": "object"}},
        usage={"type": ["object", "null"]},
        error={"type": ["object", "null"]},
        follow_token={"type": "string", "description": "Reads this response by `?token=`."},
    )
    event = _object(["data"], id={"type": "string", "pattern": "^[0-9]+$"}, data={"type": "string"})
    event["description"] = EVENTS_TEXT
    deleted = _object(
        ["id", "object", "deleted"],
        id={"type": "string"},
        object={"const": "response"},
        deleted={"const": True},
    )
    nullable_id = {"type": ["string", "null"]}
    items = _object(
        ["object", "data", "first_id", "last_id", "has_more"],
        object={"const": "list"},
        data={"type": "array", "items": {"type": "object"}},
        first_id=nullable_id,
        last_id=nullable_id,
        has_more={"type": "boolean"},
    )
    return {
        "ResponseRequest": _request(),
        "Response": response,
        "ResponseStreamEvent": event,
        "DeletedResponse": deleted,
        "ResponseItemList": items,
    }


def _query(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    param = {"name": name, "in": "query", "required": False, "schema": schema}
    return param | ({"description": description} if description else {})


def _create(either: dict[str, Any]) -> dict[str, Any]:
    return {
        "operationId": "createResponse",
        "summary": "Start a run; answer its response whole, stream its events (`stream: true`), "
        "or answer at once and run on with nobody attached (`background: true`).",
        "requestBody": {"required": True, "content": {JSON: {"schema": ref("ResponseRequest")}}},
        "responses": {
            "200": _answer("The response.", either, FOLLOW_TOKEN_HEADER),
            **_errors(400, 401, 403, 404, 408, 410, 413, 415, 422, 429, 502, 503, 504),
        },
    }


def _paths() -> dict[str, Any]:
    response = {JSON: {"schema": ref("Response")}}
    either = {**response, SSE: {"schema": ref("ResponseStreamEvent")}}
    after = _query(
        "starting_after",
        {"type": "integer", "minimum": 0},
        "Resume: the events after this `sequence_number`, then the live run.",
    )
    stream = _query("stream", {"type": "boolean"})
    retrieve = _get(
        "retrieveResponse",
        {
            "200": _answer("The response.", either, FOLLOW_TOKEN_HEADER),
            "204": NOTHING_AFTER,
            **_errors(400, 401, 404, 410, 503),
        },
        summary="The response, or (`stream=true`) its events after `starting_after`.",
        parameters=[_RUN_ID, stream, after, FOLLOW_TOKEN_PARAM],
    )
    cancel = {
        "operationId": "cancelResponse",
        "summary": "Cancel the response's run (idempotent); answers the response as it ended.",
        "parameters": [_RUN_ID],
        "responses": {"200": _answer("The response.", response), **_errors(401, 404, 503)},
    }
    delete = {
        "operationId": "deleteResponse",
        "summary": "Delete the response (a live run is cancelled).",
        "parameters": [_RUN_ID],
        "responses": {
            "200": _answer("Deleted.", {JSON: {"schema": ref("DeletedResponse")}}),
            **_errors(401, 404, 503),
        },
    }
    paging = [
        _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
        _query("order", {"enum": ["asc", "desc"]}),
        _query("after", {"type": "string"}, "An item id: the page starts after it."),
    ]
    items = _get(
        "listInputItems",
        {
            "200": _answer("The items of its input.", {JSON: {"schema": ref("ResponseItemList")}}),
            **_errors(400, 401, 404, 503),
        },
        parameters=[_RUN_ID, *paging, FOLLOW_TOKEN_PARAM],
    )
    return {
        "/v1/responses": {"post": _create(either)},
        "/v1/responses/{id}": {**retrieve, "delete": delete},
        "/v1/responses/{id}/cancel": {"post": cancel},
        "/v1/responses/{id}/input_items": items,
    }


def with_responses(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the Responses routes and schemas added."""
    document["paths"].update(_paths())
    document["components"]["schemas"].update(_schemas())
    return document
