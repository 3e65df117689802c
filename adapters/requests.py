"""The internal request model: what the gateway asks of an upstream, independent of wire format.

`gateway.protocol` parses OpenAI's JSON into these; adapters read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from wire.share import Share


class TraceHook(Protocol):
    """The run's trace as adapters see it (gateway/tracing/run_trace.py): the `traceparent` an
    upstream call carries, and events for what happened on the way (a retry, a fallback, a
    migration). Adapters know nothing of OpenTelemetry."""

    traceparent: str

    def event(self, name: str, **attributes: str | int) -> None: ...


@dataclass(slots=True)
class Message:
    role: str
    content: str | None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("name", "tool_call_id", "tool_calls"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


@dataclass(slots=True)
class ChatRequest:
    """A validated chat completion request; defaults are OpenAI's."""

    model: str
    messages: list[Message]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off; Anthropic's `top_k` (the chat API has none)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None  # as asked: auto, default, flex, priority (None: auto)
    # the last message is the assistant's, to be continued rather than answered (vLLM's and
    # SGLang's extension; the pool sets it to continue a run on another OpenAI-compatible member)
    continue_final_message: bool = False
    # set by the gateway, never by a client: the tenant (a digest), its weight and the tier
    # served, which fair sharing schedules by (design §12)
    share: Share | None = None
    # set by the gateway, never by a client: our workers share cached prompt blocks only between
    # requests of one salt (one tenant, unless it opted into sharing)
    cache_salt: str | None = None
    # set by the gateway, never by a client: the first message is a system prompt the tenants
    # file declares shared, so our workers cache that message alone for every salt
    shared_system_prompt: bool = False
    # set by the gateway, never by a client: when a worker died mid-stream, the token ids of
    # choice 0 it had streamed; the next worker goes on from them (docs/worker-api.md)
    continuation: list[int] | None = None
    # set by the gateway, never by a client: not None, the run's first role chunk carries the
    # prompt's tokens as `usage` (vLLM's continuous-usage shape): the upstream's count where it
    # reports one on accepting the run (our workers), else this, the gateway's estimate; what a
    # Messages stream's `message_start` reports
    usage_on_open: int | None = None
    # a legacy completion's raw prompt (`POST /v1/completions`): the text the model continues,
    # tokenized as is with no chat template, or its token ids; `messages` is then empty
    # (docs/worker-api.md)
    prompt: str | list[int] | None = None
    # set by the gateway when the run is traced (--otlp-endpoint): the upstream call's
    # `traceparent` and the run span's events; None when tracing is off
    trace: TraceHook | None = None
