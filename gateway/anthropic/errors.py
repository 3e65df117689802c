"""Errors on the Anthropic routes, in Anthropic's shape.

Code inside raises `APIError` as everywhere (gateway/http/errors.py); on the Messages routes the
error middleware answers it with `anthropic_response` instead: `{"type": "error", "error":
{"type", "message"}}` and Anthropic's status codes (529 where sluicegate is overloaded). The
message names the offending field first, as Anthropic's do.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.http.errors import APIError

PATH_PREFIX = "/v1/messages"  # the routes whose errors are Anthropic's
OVERLOADED = 529

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def anthropic_status(error: APIError) -> int:
    """Our status as Anthropic's: a 503 (an overloaded or draining gateway, no ready backend, the
    state store away) is its 529, which the SDK retries as it would a 503."""
    return OVERLOADED if error.status == 503 else error.status


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error object for an answer with this status."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def stream_error(error: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error object met mid-stream (the run's, the follow loop's) as Anthropic's."""
    code = error.get("code")
    if code in ("overloaded", "store_unavailable"):
        status = OVERLOADED
    elif code == "rate_limit_exceeded":
        status = 429
    elif error.get("type") == "invalid_request_error":
        status = 400
    else:
        status = 500
    return error_body(status, str(error.get("message", "The run did not complete.")))


def anthropic_response(error: APIError) -> web.Response:
    """The error answered on a Messages route."""
    status = anthropic_status(error)
    body = error_body(status, error.message, error.param)
    response = web.Response(status=status, body=orjson.dumps(body), headers=error.headers)
    response.content_type = "application/json"
    if status in (400, 401, 403, 404, 413):
        response.headers.setdefault("x-should-retry", "false")
    if error.headers.get("Connection") == "close":
        response.force_close()
    return response
