"""The OpenAPI 3.1 document of the public HTTP API, served at `GET /openapi.json` (design §4).

Built from the same limits the request parser enforces (wire/limits.py, gateway/protocol.py),
so the document and the server cannot disagree on a range or a list. It describes what the
server really does, errors included: a client generator or a contract tester (schemathesis runs
against it in the tests) reads the statuses, headers and shapes each route can answer.
"""

from __future__ import annotations

from typing import Any

from gateway.openapi.schemas import components, ref

JSON = "application/json"
SSE = "text/event-stream"

_ERROR_TEXT = {
    400: "A malformed body or a bad value; `param` names the field.",
    401: "No valid API key or JWT (or, on a run's GET routes, no valid follow token).",
    403: "The credential's tenant may not use this model.",
    404: "No such model, or no such run for this tenant (another tenant's run id included).",
    408: "The request body did not arrive within the body timeout.",
    410: "The events after `starting_after` are no longer kept.",
    413: "The request body is larger than the gateway accepts.",
    415: "The body is not `application/json`.",
    422: "The `Idempotency-Key` was used before with another body.",
    429: "A rate limit, the concurrency limit or the token budget of the tenant was reached.",
    499: "The run was cancelled before it completed (a non-streaming call waits for its run).",
    502: "The model backend failed.",
    503: "No worker can take the request now, the state store is unreachable, or draining.",
    504: "A deadline of the run passed.",
}
_RETRY = {429, 503}


def _error(status: int) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "description": _ERROR_TEXT[status],
        "content": {JSON: {"schema": ref("ErrorResponse")}},
    }
    if status in _RETRY:
        answer["headers"] = {"retry-after": {"$ref": "#/components/headers/RetryAfter"}}
    return answer


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): _error(status) for status in statuses}


_RUN_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
IDEMPOTENCY_PARAM = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~ ]+$"},
}
# A run's GET routes (gateway/http/follow_access.py): its follow token in place of a credential.
FOLLOW_TOKEN_PARAM = {
    "name": "token",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "The run's follow token (`x-follow-token`), in place of a credential: it "
    "reads this run only (for an `EventSource`, which cannot send `Authorization`).",
}
FOLLOW_TOKEN_HEADER = {
    "x-follow-token": {
        "description": "A run-scoped, expiring token that reads this run (`?token=`).",
        "schema": {"type": "string"},
    }
}
NOTHING_AFTER = {
    "description": "A resume (`stream=true`) at or after the last event of a run that has "
    "ended: nothing more will come (an `EventSource` stops reconnecting)."
}


def _get(op_id: str, responses: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"get": {"operationId": op_id, **more, "responses": responses}}


def _answer(
    description: str, content: dict[str, Any], headers: dict[str, Any] | None = None
) -> dict[str, Any]:
    answer = {"description": description, "content": content}
    return answer if headers is None else answer | {"headers": headers}


def _chat_paths() -> dict[str, Any]:
    completion = {JSON: {"schema": ref("ChatCompletion")}}
    either = {**completion, SSE: {"schema": ref("StreamEvent")}}
    no_wait = {
        "name": "x-sluice-no-wait",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "enum": ["true", "false"]},
        "description": "`true`: where the run would wait `queued` (a restarting worker, a "
        "saturated backend), answer 503 `overloaded` at once instead.",
    }
    starting_after = {
        "name": "starting_after",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0},
        "description": "Resume: replay the events after this sequence number, then follow.",
    }
    stream = {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}}
    create = {
        "operationId": "createChatCompletion",
        "summary": "Start a run; answer it whole, or stream it (`stream: true`).",
        "parameters": [IDEMPOTENCY_PARAM, no_wait],
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": ref("ChatCompletionRequest")}},
        },
        "responses": {
            "200": _answer("The completion.", either, FOLLOW_TOKEN_HEADER),
            **_errors(400, 401, 403, 404, 408, 413, 415, 422, 429, 499, 502, 503, 504),
        },
    }
    cancel = {
        "operationId": "cancelChatCompletion",
        "summary": "Cancel the run (idempotent); answers its terminal status.",
        "parameters": [_RUN_ID],
        "responses": {"200": _answer("The run as it ended.", completion), **_errors(401, 404, 503)},
    }
    retrieve = _get(
        "retrieveChatCompletion",
        {
            "200": _answer("The run.", either, FOLLOW_TOKEN_HEADER),
            "204": NOTHING_AFTER,
            **_errors(400, 401, 404, 410, 503),
        },
        summary="The run's object with its status and `follow_token`, or (`stream=true`) its "
        "events; the `Last-Event-ID` header, when sent, wins over `starting_after`.",
        parameters=[_RUN_ID, stream, starting_after, FOLLOW_TOKEN_PARAM],
    )
    return {
        "/v1/chat/completions": {"post": create},
        "/v1/chat/completions/{id}": retrieve,
        "/v1/chat/completions/{id}/cancel": {"post": cancel},
    }


def _model_paths() -> dict[str, Any]:
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/models": _get(
            "listModels",
            {
                "200": _answer("The models served.", {JSON: {"schema": ref("ModelList")}}),
                **_errors(401),
            },
        ),
        "/v1/models/{model}": _get(
            "retrieveModel",
            {"200": _answer("The model.", {JSON: {"schema": ref("Model")}}), **_errors(401, 404)},
            parameters=[model],
        ),
    }


def _public_paths() -> dict[str, Any]:
    """The routes that need no credential."""
    public: list[dict[str, list[str]]] = []
    status = {JSON: {"schema": {"type": "object", "required": ["status"]}}}
    ready = {
        "200": _answer("Every model (or some: `degraded`) can be served.", status),
        "503": _answer("Nothing can be served, the store is away, or draining.", status),
    }
    text = {"text/plain": {"schema": {"type": "string"}}}
    document = {JSON: {"schema": {"type": "object"}}}
    return {
        "/healthz": _get(
            "healthz", {"200": _answer("The process is up.", status)}, security=public
        ),
        "/readyz": _get("readyz", ready, security=public),
        "/metrics": _get(
            "metrics", {"200": _answer("Prometheus text format.", text)}, security=public
        ),
        "/openapi.json": _get(
            "openapi", {"200": _answer("This document.", document)}, security=public
        ),
    }


def openapi_document(version: str) -> dict[str, Any]:
    """The whole document; `version` is the package's."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sluicegate",
            "version": version,
            "description": "An OpenAI-compatible streaming gateway. Runs outlive connections: "
            "resume a stream by event id, cancel a run, retrieve its object.",
        },
        "security": [{"bearer": []}],
        "paths": {**_chat_paths(), **_model_paths(), **_public_paths()},
        "components": components(),
    }
