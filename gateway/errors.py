"""Domain errors and their one translation into OpenAI's error body.

Code inside raises `APIError` (or a helper below); the error middleware is the only place that
turns it into `{"error": {"message", "type", "param", "code"}}`. Anything else that escapes a
handler is logged with its traceback and answered as a bare 500 with a stable code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from aiohttp import web

from adapters.base import BackendRejected, BackendUnavailable

# Statuses a retry cannot fix: the openai SDK honours `x-should-retry: false`.
_NO_RETRY = frozenset({400, 401, 403, 404, 410, 413, 415, 422})


@dataclass(slots=True)
class APIError(Exception):
    """An error answer in OpenAI's shape; `param` names the offending field when there is one."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> web.Response:
        headers = {"Content-Type": "application/json", **self.headers}
        if self.status in _NO_RETRY:
            headers.setdefault("x-should-retry", "false")
        response = web.Response(status=self.status, body=orjson.dumps(self.body()), headers=headers)
        if headers.get("Connection") == "close":
            response.force_close()  # the rest of the request will not be read
        return response


def invalid_request(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_api_key() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided. Pass a valid key as 'Authorization: Bearer <key>'.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def overloaded(message: str, retry_after: float = 1.0) -> APIError:
    return APIError(
        503,
        message,
        type="server_error",
        code="overloaded",
        headers={"retry-after": str(max(1, round(retry_after)))},
    )


def upstream_failed(message: str = "The model backend failed to process the request.") -> APIError:
    return APIError(502, message, type="server_error", code="upstream_error")


def internal_error() -> APIError:
    return APIError(
        500,
        "The server had an error processing your request.",
        type="server_error",
        code="internal_error",
    )


def from_backend(exc: Exception) -> APIError:
    """An adapter's exception as the answer the client gets (no upstream text passes)."""
    if isinstance(exc, BackendRejected):
        if exc.status == 404:
            return APIError(404, exc.message, param=exc.param, code="model_not_found")
        if exc.status == 413:
            return APIError(413, exc.message, param=exc.param, code="request_too_large")
        return invalid_request(exc.param, exc.message, code=exc.code)
    if isinstance(exc, BackendUnavailable):
        return overloaded(exc.message, exc.retry_after)
    return upstream_failed()
