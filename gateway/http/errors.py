"""Domain errors and their one translation into OpenAI's error body.

Code inside raises `APIError` (or a helper below); the error middleware is the only place that
turns it into `{"error": {"message", "type", "param", "code"}}`. Anything else that escapes a
handler is logged with its traceback and answered as a bare 500 with a stable code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from aiohttp import web

from gateway.runs.status import RunStatus
from gateway.state.run_store import TerminalRecord
from wire.limits import shown

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


def resume_window_expired(message: str) -> APIError:
    """410: the events a resume asked for were dropped from the run's retained log."""
    return APIError(410, message, param="starting_after", code="resume_window_expired")


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
        f"The model {shown(model)} does not exist or you do not have access to it.",
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


# How a run that did not complete answers a request waiting for it: by the error's code first
# (a refusal keeps the status its code means), else by how the run ended.
_STATUS_FOR_CODE = {
    "model_not_found": 404,
    "request_too_large": 413,
    "overloaded": 503,
    "rate_limit_exceeded": 429,
    "upstream_error": 502,
    "store_unavailable": 503,
    "run_lost": 502,
}
_STATUS_FOR_END = {
    RunStatus.CANCELLED: 499,  # as "client closed request": the run was cancelled
    RunStatus.TIMED_OUT: 504,
    RunStatus.FAILED: 502,
    RunStatus.REJECTED: 400,
}


def terminal_error(terminal: TerminalRecord) -> APIError:
    """The HTTP error for a run that ended without completing (design §4)."""
    error = terminal.error or {}
    code = error.get("code")
    status = _STATUS_FOR_CODE.get(code) or _STATUS_FOR_END.get(terminal.status, 502)
    if terminal.refused and error.get("type") == "invalid_request_error":
        status = _STATUS_FOR_CODE.get(code, 400)
    headers: dict[str, str] = {}
    if terminal.retry_after is not None:
        headers["retry-after"] = str(max(1, round(terminal.retry_after)))
    if status == 503:
        headers.setdefault("retry-after", "1")
    if terminal.status in (RunStatus.CANCELLED, RunStatus.TIMED_OUT):
        headers["x-should-retry"] = "false"  # the caller's own cancel or deadline
    return APIError(
        status,
        error.get("message", "The run did not complete."),
        type=error.get("type", "server_error"),
        code=code,
        param=error.get("param"),
        headers=headers,
    )
