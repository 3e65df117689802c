"""The `/v1/generate` body of the worker API (docs/worker-api.md), both ends: the gateway's
worker adapter builds it (`GenerateRequest`), the worker server parses and validates it
(`parse_generate` → `GenerateBody`). Torch-free, like wire/api.py.

Parsing is strict about types (a bool is not an int) and names the offending field in a
`BadRequest`; unknown fields are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from wire.api import BadRequest
from wire.limits import ROLES
from wire.output_spec import ResponseFormat, ToolSpec, parse_response_format, parse_tools
from wire.sampling_params import InvalidParam, SamplingParams
from wire.share import DEFAULT_SHARE, InvalidShare, Share

MAX_REQUEST_ID_LEN = 256
# Far above any context length: the model's own limit is the worker's check (Engine.check_fits);
# this one only bounds the parsing.
MAX_CONTINUATION = 1 << 20
_MISSING = object()


# -- as the client builds it ----------------------------------------------------------------


@dataclass(slots=True)
class GenerateRequest:
    """A `/v1/generate` body as the client (the gateway's adapter) builds it: the parameters
    are the engine's own `SamplingParams`, so both ends validate them alike."""

    request_id: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    response_format: ResponseFormat | None = None
    tools: ToolSpec | None = None
    cache_salt: str | None = None
    continuation: list[int] | None = None  # choice 0's ids a dead worker already streamed
    shared_system_prompt: bool = False  # the gateway's word: the first message is declared shared
    share: Share | None = None  # its tenant (a digest), weight and tier, for fair scheduling
    continue_final_message: bool = False  # go on writing the last (assistant) message
    # raw text, or token ids, in place of `messages` (then empty): no chat template
    prompt: str | list[int] | None = None

    def to_json(self) -> bytes:
        p = self.params
        text: dict[str, Any] = (
            {"messages": self.messages} if self.prompt is None else {"prompt": self.prompt}
        )
        extra: dict[str, Any] = {}
        if self.share is not None:
            extra["share"] = self.share.wire()
        if self.cache_salt is not None:
            extra["cache_salt"] = self.cache_salt
        if self.shared_system_prompt:
            extra["shared_system_prompt"] = True
        if self.continuation is not None:
            extra["continuation"] = self.continuation
        if self.continue_final_message:
            extra["continue_final_message"] = True
        if self.response_format is not None:
            extra["response_format"] = self.response_format.wire()
        if self.tools is not None:
            extra["tools"] = [t.wire() for t in self.tools.tools]
            extra["tool_choice"] = self.tools.wire_choice()
        return orjson.dumps(
            {
                "request_id": self.request_id,
                **text,
                "max_tokens": p.max_tokens,
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k,
                "seed": p.seed,
                "stop": list(p.stop),
                "stop_token_ids": list(p.stop_token_ids),
                "n": p.n,
                "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty,
                "logprobs": p.logprobs,
                "top_logprobs": p.top_logprobs,
                "ignore_eos": p.ignore_eos,
                **extra,
            }
        )


# -- as the worker parses it ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerateBody:
    """A parsed `/v1/generate` body: the id, the chat messages and the sampling parameters."""

    request_id: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    response_format: ResponseFormat | None = None
    tools: ToolSpec | None = None
    cache_salt: str | None = None  # prefix-cache isolation (the gateway sets one per tenant)
    continuation: tuple[int, ...] = ()  # choice 0's tokens another worker already streamed
    shared_system_prompt: bool = False  # the first message may be cached for every salt
    share: Share = DEFAULT_SHARE  # its tenant, weight and tier (workers/fair_policy.py)
    continue_final_message: bool = False  # the last message is the assistant's, to go on with
    # raw text, tokenized as is, or token ids taken as they are, in place of `messages`
    prompt: str | tuple[int, ...] | None = None


def parse_share(body: dict[str, Any]) -> Share:
    """Who the request is for; a body without one shares the default tenant's place."""
    value = body.get("share")
    if value is None:
        return DEFAULT_SHARE
    try:
        return Share.from_wire(value)
    except InvalidShare as e:
        raise BadRequest(str(e), e.param) from None


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


def _token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _continuation(body: dict[str, Any], n: int) -> tuple[int, ...]:
    """Token ids another worker generated for choice 0 and the client already received."""
    value = _field(body, "continuation", [])
    if not isinstance(value, list) or not _token_ids(value):
        raise BadRequest(
            "continuation must be a list of token ids (integers >= 0)",
            "continuation",
            "invalid_type",
        )
    if len(value) > MAX_CONTINUATION:
        raise BadRequest(f"continuation has at most {MAX_CONTINUATION} ids", "continuation")
    if value and n != 1:
        raise BadRequest("continuation requires n = 1", "continuation")
    return tuple(value)


def _tool_calls(i: int, value: Any) -> list[dict[str, Any]]:
    """An assistant message's calls, as OpenAI writes them (arguments a JSON string)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list", "messages", "invalid_type")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{where} items need a function with a name", "messages")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise BadRequest(f"{where} arguments must be a JSON string", "messages")
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{i}] must be an object", "messages", "invalid_type")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {sorted(ROLES)}", "messages")
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(i, message["tool_calls"])
        out["content"] = content = content or ""
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string", "messages", "invalid_type")
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"messages[{i}].{key} must be a string", "messages", "invalid_type")
        if value is not None:
            out[key] = value
    return out


def _prompt(body: dict[str, Any]) -> str | tuple[int, ...] | None:
    """A raw prompt, the alternative to `messages` (exactly one of them is sent): text, or
    token ids (checked against the vocabulary by the worker, which knows it)."""
    value = body.get("prompt")
    if value is None:
        return None
    if isinstance(value, list) and 0 < len(value) <= MAX_CONTINUATION and _token_ids(value):
        value = tuple(value)
    elif not isinstance(value, str) or not value:
        raise BadRequest(
            "prompt must be a non-empty string or a non-empty list of token ids",
            "prompt",
            "invalid_type",
        )
    if body.get("messages") is not None:
        raise BadRequest("send either messages or prompt, not both", "prompt")
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages: role and string content, and on tool turns `tool_calls` (assistant),
    `tool_call_id` and `name` (tool)."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list", "messages", "invalid_type")
    return [_message(i, m) for i, m in enumerate(value)]


def parse_request_id(body: dict[str, Any]) -> str:
    """The body's `request_id` (every worker route's body has one); BadRequest naming it."""
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
    request_id, prompt = parse_request_id(body), _prompt(body)
    messages = [] if prompt is not None else _messages(body)
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
        response_format = parse_response_format(body.get("response_format"))
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except InvalidParam as e:
        raise BadRequest(str(e), e.param) from None
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= 256):
        raise BadRequest("cache_salt must be a string of 1 to 256 characters", "cache_salt")
    continuation = _continuation(body, params.n)
    shared = _bool(body, "shared_system_prompt", False)
    continue_final = _bool(body, "continue_final_message", False)
    if continue_final and (not messages or messages[-1]["role"] != "assistant"):
        raise BadRequest(
            "continue_final_message needs an assistant message last", "continue_final_message"
        )
    return GenerateBody(
        request_id,
        messages,
        params,
        response_format,
        tools,
        salt,
        continuation,
        shared,
        parse_share(body),
        continue_final,
        prompt,
    )
