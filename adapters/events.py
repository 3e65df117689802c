"""The internal event model every adapter produces.

Upstreams differ (our own worker's NDJSON, an OpenAI-compatible server's SSE, a scripted test
stream); past the adapter there is only this. Events are small slotted dataclasses because one is
made per streamed token on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})


@dataclass(slots=True)
class TextDelta:
    """Text for one choice; `tokens` is how many generated tokens it carries. `token_ids` are
    those tokens where the upstream names them (our worker), so a run can continue elsewhere."""

    text: str
    index: int = 0
    tokens: int = 1
    logprobs: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None


@dataclass(slots=True)
class ToolCallDelta:
    """A fragment of one tool call: id and name arrive first, arguments in pieces. `token_ids`
    as for TextDelta (our worker sends a call whole, with the ids of its markup)."""

    call_index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    index: int = 0
    token_ids: list[int] | None = None


@dataclass(slots=True)
class Finish:
    """One choice is done; `reason` is an OpenAI finish reason. `stop_string`: the request's
    stop string that ended it, where the upstream says (vLLM's `stop_reason`), else None."""

    reason: str
    index: int = 0
    stop_string: str | None = None

    def __post_init__(self) -> None:
        if self.reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {self.reason!r}")


@dataclass(slots=True)
class Usage:
    """Token counts for the whole request (all choices)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class ErrorEvent:
    """The upstream failed after the stream began. `message` is ours, never the upstream's."""

    code: str
    message: str
    type: str = "server_error"
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Accepted:
    """The upstream took the request (it validated it and queued it); nothing computed yet.
    `model`: the model serving it where that is not the one asked for (a model alias's target,
    adapters/fallback.py): the response names it. `prompt_tokens`: the prompt's tokens as the
    upstream counted them, where it says this early (our workers), else None."""

    model: str | None = None
    prompt_tokens: int | None = None


@dataclass(slots=True)
class Admitted:
    """The upstream took the request out of its queue and started computing it."""


@dataclass(slots=True)
class Aborted:
    """One choice stopped because of an abort; what it cost, as the upstream reports it."""

    index: int = 0
    completion_tokens: int = 0  # tokens this choice generated in all
    tail_tokens: int = 0  # tokens generated after the abort reached the upstream
    stop_latency_ms: float | None = None


Event = TextDelta | ToolCallDelta | Finish | Usage | ErrorEvent | Accepted | Admitted | Aborted
