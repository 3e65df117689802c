"""Per-response bookkeeping: tokens, first-token time and gaps, recorded into the metrics."""

from __future__ import annotations

import time

from adapters.events import ErrorEvent, Event, Finish, TextDelta, ToolCallDelta, Usage
from gateway.metrics import GatewayMetrics


class ResponseAccounting:
    """Watches the events of one response as they are sent to the client."""

    __slots__ = (
        "error",
        "finish_reason",
        "first_token_at",
        "last_token_at",
        "metrics",
        "model",
        "sent_tokens",
        "started",
        "usage",
    )

    def __init__(self, metrics: GatewayMetrics, model: str, started: float) -> None:
        self.metrics = metrics
        self.model = model
        self.started = started
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.sent_tokens = 0
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.error: ErrorEvent | None = None

    def observe(self, batch: list[Event]) -> None:
        """Record a batch about to be written to the client."""
        now = time.monotonic()
        for event in batch:
            kind = type(event)
            if kind is TextDelta or kind is ToolCallDelta:
                if kind is TextDelta:
                    self.sent_tokens += event.tokens
                if self.first_token_at is None:
                    self.first_token_at = now
                    self.metrics.ttft.observe(now - self.started)
                else:
                    self.metrics.inter_token.observe(now - self.last_token_at)
                self.last_token_at = now
            elif kind is Finish:
                if self.finish_reason is None or event.index == 0:
                    self.finish_reason = event.reason
            elif kind is Usage:
                self.usage = event
            elif kind is ErrorEvent:
                self.error = event

    def close(self, outcome: str | None = None) -> None:
        """Record the end of the response; `outcome` overrides the finish reason."""
        reason = outcome or (self.error and "error") or self.finish_reason or "error"
        m = self.metrics
        m.runs_finished.labels(self.model, reason).inc()
        m.e2e.observe(time.monotonic() - self.started)
        m.tokens.labels("sent").inc(self.sent_tokens)
        if self.usage is not None:
            m.tokens.labels("prompt").inc(self.usage.prompt_tokens)
            m.tokens.labels("generated").inc(self.usage.completion_tokens)
