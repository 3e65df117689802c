"""The worker API's wire format (docs/worker-api.md): request parsing and the NDJSON events.

The only module that knows the field names of `/v1/generate`, so the server stays thin and the
engine builds events through these helpers. Parsing is strict about types (a bool is not an int)
and names the offending field; unknown fields are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workers.limits import ROLES
from workers.sampling_params import InvalidParam, SamplingParams

API_VERSION = 1
MAX_REQUEST_ID_LEN = 256
_MISSING = object()


class BadRequest(Exception):
    """A 400 before the stream starts; `param` names the field."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class GenerateBody:
    """A parsed `/v1/generate` body: the id, the chat messages and the sampling parameters."""

    request_id: str
    messages: list[dict[str, str]]
    params: SamplingParams


def error_body(
    message: str, code: str, param: str | None = None, type_: str = "invalid_request_error"
) -> dict[str, Any]:
    """OpenAI's error shape; `code` is always a string."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _field(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name, _MISSING)
    return default if value is _MISSING or value is None else value


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = _field(body, name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{name} must be an integer", name, "invalid_type")
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = _field(body, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name} must be a number", name, "invalid_type")
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be finite", name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = _field(body, name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", name, "invalid_type")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = _field(body, "stop", [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop must be a string or a list of strings", "stop", "invalid_type")
    return tuple(value)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    value = _field(body, "stop_token_ids", [])
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise BadRequest(
            "stop_token_ids must be a list of integers", "stop_token_ids", "invalid_type"
        )
    return tuple(value)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list", "messages", "invalid_type")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages", "invalid_type")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {sorted(ROLES)}", "messages")
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages", "invalid_type")
        messages.append({"role": role, "content": content})
    return messages


def _request_id(body: dict[str, Any]) -> str:
    value = body.get("request_id")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_LEN:
        raise BadRequest(
            f"request_id must be a string of 1 to {MAX_REQUEST_ID_LEN} characters",
            "request_id",
            "invalid_type",
        )
    return value


def parse_generate(body: Any) -> GenerateBody:
    """Validate a decoded JSON body; raises BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None, "invalid_type")
    request_id, messages = _request_id(body), _messages(body)
    try:
        params = SamplingParams(
            max_tokens=_int(body, "max_tokens", None),
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0),
            seed=_int(body, "seed", None),
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body),
            n=_int(body, "n", 1),
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            logprobs=_bool(body, "logprobs", False),
            top_logprobs=_int(body, "top_logprobs", 0),
            ignore_eos=_bool(body, "ignore_eos", False),
        )
    except InvalidParam as e:
        raise BadRequest(str(e), e.param) from None
    return GenerateBody(request_id, messages, params)


def start_event(prompt_tokens: int) -> dict[str, Any]:
    return {"type": "start", "prompt_tokens": prompt_tokens}


def admitted_event() -> dict[str, Any]:
    """Once per request, when the engine first schedules it: it has left the queue."""
    return {"type": "admitted"}


def text_event(
    index: int, text: str, tokens: int, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "text", "index": index, "text": text, "tokens": tokens}
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event


def finish_event(index: int, reason: str, completion_tokens: int) -> dict[str, Any]:
    return {
        "type": "finish",
        "index": index,
        "reason": reason,
        "completion_tokens": completion_tokens,
    }


def abort_event(
    index: int, completion_tokens: int, tail_tokens: int, stop_latency_s: float
) -> dict[str, Any]:
    """`finish` with reason `abort`, plus what the abort cost: tokens generated after it arrived
    and the time from its arrival to the step boundary where the sequence stopped."""
    event = finish_event(index, "abort", completion_tokens)
    event["tail_tokens"] = tail_tokens
    event["stop_latency_ms"] = round(stop_latency_s * 1000, 3)
    return event


def usage_event(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"type": "usage", "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def error_event(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message}
