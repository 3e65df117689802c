"""How a run that did not complete ends on the wire: its terminal record and error frame.

One place builds both, so the run driver and a replica marking another's orphaned run failed
give clients the same answer (design §2: a cancelled or timed-out stream ends with an error
event whose `code` is `cancelled` / `timeout`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson

from adapters.base import BackendRejected, BackendUnavailable
from adapters.events import Admitted, ErrorEvent, Event, TextDelta, ToolCallDelta
from gateway.runs.flow_control import Shed
from gateway.runs.status import TERMINAL_ERROR_CODE, RunStatus
from gateway.state.run_store import Chunk, TerminalRecord, log_chunk

_MESSAGES = {
    "cancelled": "The run was cancelled.",
    "timeout": "The run exceeded its deadline.",
    "upstream_error": "The model backend failed to process the request.",
    "run_lost": "The gateway replica running this request stopped before it ended.",
    "store_unavailable": "The gateway's state store stayed unreachable, so the run was stopped.",
}

_SHED = (
    "This request waited for capacity in the 'flex' tier and gave its place to one of a higher "
    "tier; retry later."
)
LOST_CAUSE = "owner_lost"
STORE_LOST_CAUSE = "store_unavailable"
SHUTDOWN = "shutdown"  # the cancel source of runs still live when a drain's time is up
# NOTE: the code stays `cancelled` (a client's handling of a cancel holds); the message says why
_CAUSE_MESSAGES = {
    f"cancel:{SHUTDOWN}": "The gateway is shutting down, so the run was cancelled; "
    "retry the request on another replica.",
}
_DEADLINES = {
    "deadline:queue": "waiting for the model (--queue-timeout)",
    "deadline:ttft": "to the first token (--ttft-timeout)",
    "deadline:inter_token": "between tokens (--inter-token-timeout)",
    "deadline:total": "for the whole request (--total-timeout)",
}


def error_code(status: RunStatus, cause: str) -> str:
    if cause == LOST_CAUSE:
        return "run_lost"
    if cause == STORE_LOST_CAUSE:
        return "store_unavailable"
    return TERMINAL_ERROR_CODE[status]


def store_unavailable_error() -> dict:
    """The error frame of a stream whose store stayed away past the outage grace."""
    code = STORE_LOST_CAUSE
    return {"message": _MESSAGES[code], "type": "server_error", "param": None, "code": code}


def ending(
    status: RunStatus,
    cause: str,
    completion: bytes | None = None,
    error: dict | None = None,
) -> tuple[TerminalRecord, Chunk]:
    """The terminal record of a run that stopped early, and the error frame its stream ends
    with; `error` replaces the standard body (an upstream's error event, already ours)."""
    if error is None:
        code = error_code(status, cause)
        message = _CAUSE_MESSAGES.get(cause) or _MESSAGES.get(code, "The request was rejected.")
        if cause in _DEADLINES:
            message = f"The run exceeded its deadline {_DEADLINES[cause]}."
        error = {
            "message": message,
            "type": "server_error",
            "param": None,
            "code": code,
        }
    record = TerminalRecord(status, cause, None, completion, error, at=time.time())
    return record, log_chunk(orjson.dumps({"error": error}))


def refusal(exc: Exception) -> TerminalRecord:
    """The ending of a run its upstream turned down before any event (the adapter raised): the
    request that started it answers with this error as plain HTTP. Our own codes only; an
    upstream's text never passes (the adapters see to that)."""
    cause = f"upstream:{type(exc).__name__}"
    retry_after = None
    if isinstance(exc, Shed):  # its tenant's full queue made room for a higher tier
        status, kind, code = RunStatus.REJECTED, "requests", "rate_limit_exceeded"
        message, param, retry_after = _SHED, None, exc.retry_after
    elif isinstance(exc, BackendRejected):
        status, kind = RunStatus.REJECTED, "invalid_request_error"
        code = {404: "model_not_found", 413: "request_too_large"}.get(exc.status, exc.code)
        message, param = exc.message, exc.param
    elif isinstance(exc, BackendUnavailable):
        status, kind, code = RunStatus.FAILED, "server_error", "overloaded"
        message, param, retry_after = exc.message, None, exc.retry_after
    else:
        status, kind, code = RunStatus.FAILED, "server_error", "upstream_error"
        message, param = _MESSAGES["upstream_error"], None
    error = {"message": message, "type": kind, "param": param, "code": code}
    return TerminalRecord(
        status, cause, error=error, at=time.time(), refused=True, retry_after=retry_after
    )


def stage_failure(events: list[Event]) -> ErrorEvent | None:
    """The refusal a stage put among what it let through (an invalid tool call), if any."""
    for event in events:
        if type(event) is ErrorEvent:
            return event
    return None


def error_body(failure: ErrorEvent) -> dict:
    """An error event as the run's terminal error (the `error` frame's object)."""
    return {"message": failure.message, "type": failure.type, "param": None, "code": failure.code}


@dataclass(slots=True)
class BatchScan:
    """What one batch from the backend says about the run: whether it carries tokens, whether
    the backend admitted the run, and the failure it reports (the events before it kept)."""

    events: list[Event]
    tokens: bool = False
    admitted: bool = False
    failure: ErrorEvent | None = None


def scan_batch(batch: list[Event]) -> BatchScan:
    scan = BatchScan(batch)
    for i, event in enumerate(batch):
        kind = type(event)
        if kind is TextDelta or kind is ToolCallDelta:
            scan.tokens = True
        elif kind is Admitted:
            scan.admitted = True
        elif kind is ErrorEvent:
            scan.failure, scan.events = event, batch[:i]
            break
    return scan
