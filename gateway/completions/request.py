"""The legacy Completions request (`POST /v1/completions`): parsed into the same `ChatRequest`
a chat completion is, with its raw `prompt` in place of messages.

The fields both APIs share (`temperature`, `top_p`, `n`, `stop`, `seed`, `stream`,
`stream_options`, penalties, `user`, `service_tier`) are checked by the chat parser itself, so
both refuse alike. What is the legacy API's own is checked here: `prompt` (a string, or an array
holding one string), `max_tokens` (default 16, as OpenAI's), `logprobs` (an integer: how many
alternatives per token, 0 to 5), `echo` (false only), `suffix` and `best_of` (refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.requests import ChatRequest
from gateway.http.errors import invalid_request
from gateway.protocol import parse_chat_request

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a legacy completion
MAX_LOGPROBS = 5  # OpenAI's largest `logprobs` for a legacy completion
META = "completion"  # the run record's meta key: the run answers as a `text_completion`

# fields of the chat parser a legacy request has no business sending
_CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "response_format",
    "top_logprobs",
    "max_completion_tokens",
    "continue_final_message",
    "add_generation_prompt",
    "metadata",
)


@dataclass(frozen=True, slots=True)
class CompletionParams:
    """What a legacy completion's answer needs beyond its run: kept in the run's meta."""

    n: int
    include_usage: bool

    def to_meta(self) -> dict[str, Any]:
        return {"n": self.n, "include_usage": self.include_usage}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> CompletionParams:
        return cls(meta["n"], meta["include_usage"])


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if prompt == "":
        raise invalid_request("prompt", "Invalid 'prompt': it must not be empty.")
    if prompt is None:
        raise invalid_request(
            "prompt", "Missing required parameter: 'prompt'.", code="missing_required_parameter"
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise invalid_request(
            "prompt",
            "Invalid 'prompt': only one prompt per request is supported; send each prompt in a "
            "request of its own (use 'n' for several completions of one prompt).",
            code="unsupported_value",
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, int | list) for p in prompt):
        raise invalid_request(
            "prompt",
            "Invalid 'prompt': token ids are not supported; send the prompt as a string.",
            code="unsupported_value",
        )
    raise invalid_request(
        "prompt",
        "Invalid type for 'prompt': expected a string or an array of one string.",
        code="invalid_type",
    )


def _logprobs(body: dict[str, Any]) -> int | None:
    value = body.get("logprobs")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(
            "logprobs", "Invalid type for 'logprobs': expected an integer.", code="invalid_type"
        )
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid_request(
            "logprobs",
            f"Invalid value for 'logprobs': {value}; it must be between 0 and {MAX_LOGPROBS}.",
        )
    return value


def _refused(body: dict[str, Any], n: int) -> None:
    """The legacy fields this gateway does not honour: each a 400 naming it."""
    if body.get("suffix") not in (None, ""):
        raise invalid_request(
            "suffix", "'suffix' is not supported by sluicegate.", code="unsupported_parameter"
        )
    if body.get("echo") not in (None, False):
        raise invalid_request(
            "echo", "'echo' is not supported by sluicegate.", code="unsupported_parameter"
        )
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int)):
        raise invalid_request(
            "best_of", "Invalid type for 'best_of': expected an integer.", code="invalid_type"
        )
    if best_of is not None and best_of != n:
        raise invalid_request(
            "best_of",
            "'best_of' other than 'n' is not supported by sluicegate.",
            code="unsupported_parameter",
        )


def parse_completion_request(body: Any) -> tuple[ChatRequest, CompletionParams]:
    """Validate a decoded legacy Completions body; raise `APIError` naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The request body must be a JSON object.", code="invalid_type")
    prompt = _prompt(body)
    logprobs = _logprobs(body)
    chat_body = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    chat_body["messages"] = [{"role": "user", "content": prompt}]  # parsed, then replaced
    chat_body["logprobs"] = logprobs is not None
    if logprobs:
        chat_body["top_logprobs"] = logprobs
    if body.get("max_tokens") is None:
        chat_body["max_tokens"] = DEFAULT_MAX_TOKENS
    chat = parse_chat_request(chat_body)
    _refused(body, chat.n)
    chat.messages = []
    chat.prompt = prompt
    return chat, CompletionParams(chat.n, chat.include_usage)
