"""The legacy Completions request (`POST /v1/completions`): parsed into the same `ChatRequest`
a chat completion is, with its raw `prompt` in place of messages, one per prompt asked for.

The fields both APIs share (`temperature`, `top_p`, `n`, `stop`, `seed`, `stream`,
`stream_options`, penalties, `user`, `service_tier`) are checked by the chat parser itself, so
both refuse alike. What is the legacy API's own is checked here: `prompt` (a string, a list of
strings, a list of token ids or a list of such lists: each prompt becomes a run of its own),
`max_tokens` (default 16, as OpenAI's), `logprobs` (an integer: how many alternatives per token,
0 to 5), `echo` (of a text prompt, without `logprobs`), `suffix` and `best_of` (refused).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from adapters.requests import ChatRequest
from gateway.http.errors import invalid_request
from gateway.protocol import parse_chat_request
from gateway.token_ids import texts_or_ids

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a legacy completion
MAX_LOGPROBS = 5  # OpenAI's largest `logprobs` for a legacy completion
# NOTE: each prompt is a run of its own (its own reservation, slot and ledger record), so the
# bound is on how many runs one call may open at once, well under a tenant's usual concurrency
MAX_PROMPTS = 32
META = "completion"  # the run record's meta key: the run answers as a `text_completion`

Prompt = str | list[int]

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
    """What one run's legacy answer needs beyond the run: kept in the run's meta. `index`: the
    run's prompt's place in its request (its choices are `index * n + choice`); `echo`: the
    prompt text each choice's text begins with (None: no echo)."""

    n: int
    include_usage: bool
    index: int = 0
    echo: str | None = None

    @property
    def first_choice(self) -> int:
        return self.index * self.n

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"n": self.n, "include_usage": self.include_usage}
        if self.index:
            meta["index"] = self.index
        if self.echo is not None:
            meta["echo"] = self.echo
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> CompletionParams:
        return cls(meta["n"], meta["include_usage"], meta.get("index", 0), meta.get("echo"))


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """A parsed request: the shared fields (`chat`, its prompt the first one's) and every
    prompt, each to become a run of its own."""

    chat: ChatRequest
    prompts: list[Prompt]
    include_usage: bool
    echo: bool

    def runs(self) -> list[tuple[ChatRequest, CompletionParams]]:
        """Each prompt's request and its answer's parameters, in the prompts' order."""
        out = []
        for index, prompt in enumerate(self.prompts):
            echo = prompt if self.echo and isinstance(prompt, str) else None
            params = CompletionParams(self.chat.n, self.include_usage, index, echo)
            out.append((replace(self.chat, prompt=prompt), params))
        return out


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    """The prompts: one string, a list of strings, a list of token ids, a list of such lists."""
    return texts_or_ids(body.get("prompt"), "prompt", MAX_PROMPTS)


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


def _echo(body: dict[str, Any], prompts: list[Prompt], logprobs: int | None) -> bool:
    """Whether each choice's text begins with its prompt: only a text prompt's, and not with
    `logprobs` (that would ask for the prompt's own logprobs, which the workers do not give)."""
    echo = body.get("echo")
    if echo is None or echo is False:
        return False
    if echo is not True:
        raise invalid_request(
            "echo", "Invalid type for 'echo': expected a boolean.", "invalid_type"
        )
    if logprobs is not None:
        raise invalid_request(
            "echo",
            "'echo' with 'logprobs' is not supported by sluicegate: the prompt's own logprobs "
            "are not available.",
            code="unsupported_parameter",
        )
    if not all(isinstance(p, str) for p in prompts):
        raise invalid_request(
            "echo",
            "'echo' is supported for text prompts only, not token ids.",
            code="unsupported_parameter",
        )
    return True


def _refused(body: dict[str, Any], n: int) -> None:
    """The legacy fields this gateway does not honour: each a 400 naming it."""
    if body.get("suffix") not in (None, ""):
        raise invalid_request(
            "suffix", "'suffix' is not supported by sluicegate.", code="unsupported_parameter"
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


def parse_completion_request(body: Any) -> CompletionCall:
    """Validate a decoded legacy Completions body; raise `APIError` naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The request body must be a JSON object.", code="invalid_type")
    prompts = _prompts(body)
    logprobs = _logprobs(body)
    chat_body = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    chat_body["messages"] = [{"role": "user", "content": "-"}]  # parsed, then replaced
    chat_body["logprobs"] = logprobs is not None
    if logprobs:
        chat_body["top_logprobs"] = logprobs
    if body.get("max_tokens") is None:
        chat_body["max_tokens"] = DEFAULT_MAX_TOKENS
    chat = parse_chat_request(chat_body)
    _refused(body, chat.n)
    echo = _echo(body, prompts, logprobs)
    chat.messages = []
    chat.prompt = prompts[0]
    return CompletionCall(chat, prompts, chat.include_usage, echo)
