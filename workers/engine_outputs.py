"""What the engine hands out: the events of a step per request, stats snapshots, and the refusals
of a request that can never fit or never continue. Kept apart so the engine's callers (async
loop, service, metrics) depend on these types, not on the engine's internals."""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.api import Line


class ContextTooLong(ValueError):
    """The request can never run here: too long for the context or the KV cache; `param` is
    the field to change (`messages` or `max_tokens`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class InvalidContinuation(ValueError):
    """A continuation this run could not have produced: a token its grammar refuses, or one
    after the token that ended it (another worker would have stopped there)."""


@dataclass(slots=True)
class RequestOutput:
    """Events produced for one request in one step; `finished` when it sent its last event."""

    request_id: str
    events: list[Line] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /v1/stats and /metrics."""

    waiting: int
    running: int
    generated_tokens_total: int
    last_step_tokens: int = 0
    preemptions_total: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)  # by reason: kv, fairness, priority
    max_num_seqs: int = 0  # sequences it runs at once: what a gateway's flow control sizes by
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    steps_total: int = 0  # engine steps run: a member with work whose count stands still is hung
    spec_draft_tokens: int = 0  # speculative draft tokens verified (speculative.py)
    spec_accepted_tokens: int = 0  # of those, the ones the model agreed with
