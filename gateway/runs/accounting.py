"""What one run cost and how it ended, recorded once into the metrics and one log line.

Generation-side times (TTFT, gaps between tokens) are taken as events reach the run's log, not
as a client reads them: a slow or absent client must not bend them. Time blocked on clients is
measured by the stream writers apart (DESIGN §3). Tail tokens are tokens that reached the
gateway after a cancel decision and so were never sent: the work the cancel did not save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from adapters.events import Aborted, Event, TextDelta, ToolCallDelta, Usage
from gateway.metrics import GatewayMetrics
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from gateway.runs.store import TerminalRecord

log = structlog.get_logger("sluice.runs")

# `sluice_runs_finished_total{reason}` for runs that did not complete
_END_REASON = {
    RunStatus.CANCELLED: "cancelled",
    RunStatus.TIMED_OUT: "timeout",
    RunStatus.FAILED: "error",
    RunStatus.REJECTED: "rejected",
}


@dataclass(slots=True)
class Decision:
    """The first of complete / fail / cancel / deadline to happen: the run's fate."""

    status: RunStatus
    cause: str
    source: str | None = None  # a cancel's source (`client`, `disconnect`, `timeout`, …)
    at: float = 0.0  # time.monotonic()


class RunAccounting:
    __slots__ = (
        "aborted_tokens",
        "confirmed_at",
        "first_token_at",
        "last_token_at",
        "metrics",
        "model",
        "sent_tokens",
        "started",
        "tail_tokens",
        "terminal_at",
        "upstream_stop_ms",
        "upstream_tail_tokens",
        "usage",
    )

    def __init__(self, metrics: GatewayMetrics, model: str, started: float) -> None:
        self.metrics = metrics
        self.model = model
        self.started = started
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.terminal_at: float | None = None
        self.confirmed_at: float | None = None
        self.sent_tokens = 0
        self.tail_tokens = 0
        self.aborted_tokens = 0  # generated, as the upstream's abort confirmations report
        self.upstream_tail_tokens = 0  # generated after the abort reached the upstream
        self.upstream_stop_ms: float | None = None  # abort arrival → the upstream's stop
        self.usage: Usage | None = None

    def sent(self, batch: list[Event]) -> None:
        """A batch whose chunks went into the run's log."""
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
            elif kind is Usage:
                self.usage = event

    def held_back(self, batch: list[Event]) -> None:
        """A batch that arrived after the run's fate was decided: not sent, counted as tail."""
        for event in batch:
            kind = type(event)
            if kind is TextDelta:
                self.tail_tokens += event.tokens
                self.last_token_at = time.monotonic()
            elif kind is Aborted:
                self.aborted_tokens += event.completion_tokens
                self.upstream_tail_tokens += event.tail_tokens
                if event.stop_latency_ms is not None:
                    self.upstream_stop_ms = max(self.upstream_stop_ms or 0.0, event.stop_latency_ms)
            elif kind is Usage:
                self.usage = event

    @property
    def generated_tokens(self) -> int:
        counted = self.sent_tokens + self.tail_tokens
        reported = self.usage.completion_tokens if self.usage else self.aborted_tokens
        return max(counted, reported)

    def settle(
        self,
        run_id: str,
        tenant: str,
        decision: Decision | None,
        terminal: TerminalRecord | None,
        principal: str = "",
    ) -> None:
        """Record the run's end, once, after the upstream is done with it."""
        m = self.metrics
        status = terminal.status if terminal else RunStatus.FAILED
        reason = terminal.finish_reason if terminal and terminal.finish_reason else None
        m.runs_finished.labels(self.model, reason or _END_REASON.get(status, "error")).inc()
        m.e2e.observe(self.e2e_s)
        if self.last_token_at is not None and self.terminal_at is not None:
            m.tail_latency.observe(max(0.0, self.terminal_at - self.last_token_at))
        m.tokens.labels("sent").inc(self.sent_tokens)
        m.tokens.labels("tail").inc(self.tail_tokens)
        m.tokens.labels("generated").inc(self.generated_tokens)
        if self.usage is not None:
            m.tokens.labels("prompt").inc(self.usage.prompt_tokens)
        if terminal is not None and terminal.cause.startswith("deadline:"):
            m.deadlines.labels(terminal.cause.removeprefix("deadline:")).inc()
        source = decision.source if decision else None
        outcome = None
        if source is not None and decision is not None:
            outcome = self.cancel_outcome
            m.cancellations.labels(source, outcome).inc()
            m.cancel_tail_tokens.observe(self.tail_tokens)
            if self.confirmed_at is not None:
                m.cancel_latency.observe(max(0.0, self.confirmed_at - decision.at))
        log.info(
            "run end",
            run_id=run_id,
            tenant=tenant,
            principal=principal,
            model=self.model,
            status=PUBLIC_STATUS[status],
            cause=terminal.cause if terminal else None,
            finish_reason=reason,
            prompt_tokens=self.usage.prompt_tokens if self.usage else None,
            generated_tokens=self.generated_tokens,
            sent_tokens=self.sent_tokens,
            tail_tokens=self.tail_tokens,
            cancel_source=source,
            cancel_outcome=outcome,
            cancel_latency_ms=_ms(decision.at, self.confirmed_at) if source and decision else None,
            upstream_tail_tokens=self.upstream_tail_tokens if source else None,
            upstream_stop_ms=self.upstream_stop_ms,
            ttft_s=_round(self.ttft_s),
            e2e_s=_round(self.e2e_s),
        )

    @property
    def ttft_s(self) -> float | None:
        """Request received → first token in the log."""
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def e2e_s(self) -> float:
        """Request received → terminal state recorded (or now, if not yet)."""
        return (self.terminal_at or time.monotonic()) - self.started

    @property
    def cancel_outcome(self) -> str:
        if self.confirmed_at is None:
            return "unconfirmed"
        return "tail" if self.tail_tokens else "clean"


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000, 3)
