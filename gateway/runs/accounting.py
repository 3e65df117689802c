"""What one run cost and how it ended: counted while it runs, then one `RunOutcome`, recorded
once into the metrics and one "run end" log line.

Generation-side times (TTFT, gaps between tokens) are taken as events reach the run's log, not
as a client reads them: a slow or absent client must not bend them. Time blocked on clients is
measured by the stream writers apart (design §3). Tail tokens are tokens that reached the
gateway after the run's fate was decided and so were never sent: the work a cancel did not save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from adapters.events import Aborted, Event, TextDelta, ToolCallDelta, Usage
from gateway.metrics import GatewayMetrics
from gateway.prices import Price
from gateway.runs.spec import RunOutcome, RunSpec
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from gateway.state.ledger import UsageRecord
from gateway.state.run_store import TerminalRecord
from gateway.tracing import RunTrace

log = structlog.get_logger("sluice.runs")

# `sluice_runs_finished_total{reason}` for runs that did not complete
_END_REASON = {
    RunStatus.CANCELLED: "cancelled",
    RunStatus.TIMED_OUT: "timeout",
    RunStatus.FAILED: "error",
    RunStatus.REJECTED: "rejected",
}


@dataclass(slots=True, frozen=True)
class Ending:
    """The run's fate, decided by the first of completion, failure, cancel or deadline."""

    status: RunStatus
    cause: str
    source: str | None = None  # what stopped it early (`client`, `timeout`, …); None otherwise
    at: float = 0.0  # time.monotonic()
    error: dict | None = None  # the error it ends with, when not the standard one for `cause`


class RunAccounting:
    """The counters of one run, fed by the driver as events arrive."""

    __slots__ = (
        "aborted_tokens",
        "arrived_tokens",
        "confirmed_at",
        "exemplar",
        "first_arrival_at",
        "first_token_at",
        "last_arrival_at",
        "last_token_at",
        "metrics",
        "sent_tokens",
        "started",
        "tail_tokens",
        "terminal_at",
        "upstream_stop_ms",
        "upstream_tail_tokens",
        "usage",
    )

    def __init__(
        self, metrics: GatewayMetrics, started: float, trace: RunTrace | None = None
    ) -> None:
        """`trace`: the run's span, which reads these counters at the run's end."""
        self.metrics = metrics
        self.started = started
        # the sampled trace's id on this run's histogram observations (None: untraced)
        self.exemplar = None if trace is None else trace.attach(self)
        self.first_token_at: float | None = None  # tokens reaching the log
        self.last_token_at: float | None = None
        # tokens reaching the gateway (the deadlines watch the upstream, not a stage's hold)
        self.first_arrival_at: float | None = None
        self.last_arrival_at: float | None = None
        self.terminal_at: float | None = None
        self.confirmed_at: float | None = None  # the upstream confirmed an early stop
        self.sent_tokens = 0
        self.arrived_tokens = 0  # reached the gateway while the run was live (sent or held)
        self.tail_tokens = 0
        self.aborted_tokens = 0  # generated, as the upstream's abort confirmations report
        self.upstream_tail_tokens = 0  # generated after the abort reached the upstream
        self.upstream_stop_ms: float | None = None  # abort arrival → the upstream's stop
        self.usage: Usage | None = None

    def arrived(self, batch: list[Event]) -> None:
        """A batch as it came from the upstream, before any stage held part of it back."""
        now = None
        for event in batch:
            kind = type(event)
            if kind is TextDelta:
                self.arrived_tokens += event.tokens
            if now is None and (kind is TextDelta or kind is ToolCallDelta):
                now = time.monotonic()
                if self.first_arrival_at is None:
                    self.first_arrival_at = now
                self.last_arrival_at = now

    def sent(self, batch: list[Event]) -> None:
        """The events of a batch whose chunks went into the run's log."""
        now = time.monotonic()
        for event in batch:
            kind = type(event)
            if kind is TextDelta or kind is ToolCallDelta:
                if kind is TextDelta:
                    self.sent_tokens += event.tokens
                if self.first_token_at is None:
                    self.first_token_at = now
                    self.metrics.ttft.observe(now - self.started, self.exemplar)
                else:
                    self.metrics.inter_token.observe(now - self.last_token_at)
                self.last_token_at = now
            elif kind is Usage:
                self.usage = event

    def text_passed(self, batch: list[Event]) -> None:
        """`arrived` and `sent` at once, for a batch of text deltas after the run's first
        token that no stage held back (RunPipeline.plain_text)."""
        now = self.last_arrival_at = time.monotonic()
        observe = self.metrics.inter_token.observe
        for event in batch:
            self.arrived_tokens += event.tokens
            self.sent_tokens += event.tokens
            observe(now - self.last_token_at)
            self.last_token_at = now

    def held_back(self, batch: list[Event]) -> None:
        """A batch that arrived after the run's fate was decided: not sent, counted as tail."""
        for event in batch:
            if type(event) is TextDelta:
                self.tail_tokens += event.tokens
                self.last_token_at = time.monotonic()
        self._reports(batch)

    def kept_out(self, batch: list[Event]) -> None:
        """A batch that arrived while the run was live but was kept out of the log: its fate was
        decided while a stage judged it, or the log was closed under it. NOTE: `arrived` has
        counted its text already (generated, neither sent nor tail); counting it again as tail
        would bill it twice. Only the upstream's reports in it are kept."""
        self._reports(batch)

    def _reports(self, batch: list[Event]) -> None:
        """What the upstream says a run cost: its usage, its abort confirmations."""
        for event in batch:
            kind = type(event)
            if kind is Aborted:
                self.aborted_tokens += event.completion_tokens
                self.upstream_tail_tokens += event.tail_tokens
                if event.stop_latency_ms is not None:
                    self.upstream_stop_ms = max(self.upstream_stop_ms or 0.0, event.stop_latency_ms)
            elif kind is Usage:
                self.usage = event

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's tokens as the upstream reported them (None: it never said)."""
        return self.usage.prompt_tokens if self.usage else None

    @property
    def generated_tokens(self) -> int:
        counted = self.arrived_tokens + self.tail_tokens  # what a stage held back included
        reported = self.usage.completion_tokens if self.usage else self.aborted_tokens
        return max(counted, reported)

    def outcome(
        self,
        spec: RunSpec,
        ending: Ending | None,
        terminal: TerminalRecord,
        model: str | None = None,
    ) -> RunOutcome:
        """The run's account, once its terminal state is recorded and the upstream is done;
        `model`: the model that served it (an alias's target), when not the one asked for."""
        now = time.monotonic()
        source = ending.source if ending else None
        confirmed = self.confirmed_at
        tail_latency = None
        if self.last_token_at is not None and self.terminal_at is not None:
            tail_latency = max(0.0, self.terminal_at - self.last_token_at)
        cancel_outcome = None
        if source is not None and confirmed is None:
            cancel_outcome = "unconfirmed"
        elif source is not None:
            cancel_outcome = "tail" if self.tail_tokens else "clean"
        return RunOutcome(
            run_id=spec.run_id,
            tenant=spec.tenant,
            principal=spec.principal,
            model=model or spec.chat.model,
            terminal=terminal,
            cancel_source=source,
            cancel_outcome=cancel_outcome,
            cancel_latency_ms=(
                None if ending is None or confirmed is None else _ms(confirmed - ending.at)
            ),
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            sent_tokens=self.sent_tokens,
            tail_tokens=self.tail_tokens,
            upstream_tail_tokens=self.upstream_tail_tokens if source else None,
            upstream_stop_ms=self.upstream_stop_ms,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.started,
            e2e_s=(self.terminal_at or now) - self.started,
            tail_latency_s=tail_latency,
            safety=None if spec.safety is None else spec.safety.label,
            exemplar=self.exemplar,
        )


def record_outcome(metrics: GatewayMetrics, outcome: RunOutcome) -> None:
    """The run's metrics and its "run end" log line, once."""
    m, terminal = metrics, outcome.terminal
    reason = terminal.finish_reason
    m.runs_finished.labels(outcome.model, reason or _END_REASON.get(terminal.status, "error")).inc()
    m.e2e.observe(outcome.e2e_s, outcome.exemplar)
    if outcome.tail_latency_s is not None:
        m.tail_latency.observe(outcome.tail_latency_s)
    m.tokens.labels("sent").inc(outcome.sent_tokens)
    m.tokens.labels("tail").inc(outcome.tail_tokens)
    m.tokens.labels("generated").inc(outcome.generated_tokens)
    if outcome.prompt_tokens is not None:
        m.tokens.labels("prompt").inc(outcome.prompt_tokens)
    if terminal.cause.startswith("deadline:"):
        m.deadlines.labels(terminal.cause.removeprefix("deadline:")).inc()
    if outcome.cancel_source is not None:
        m.cancellations.labels(outcome.cancel_source, outcome.cancel_outcome).inc()
        m.cancel_tail_tokens.observe(outcome.tail_tokens)
        if outcome.cancel_latency_ms is not None:
            m.cancel_latency.observe(max(0.0, outcome.cancel_latency_ms / 1000))
    log.info(
        "run end",
        run_id=outcome.run_id,
        tenant=outcome.tenant,
        principal=outcome.principal,
        model=outcome.model,
        safety=outcome.safety,
        status=PUBLIC_STATUS[terminal.status],
        cause=terminal.cause,
        finish_reason=reason,
        prompt_tokens=outcome.prompt_tokens,
        generated_tokens=outcome.generated_tokens,
        sent_tokens=outcome.sent_tokens,
        tail_tokens=outcome.tail_tokens,
        cancel_source=outcome.cancel_source,
        cancel_outcome=outcome.cancel_outcome,
        cancel_latency_ms=outcome.cancel_latency_ms,
        upstream_tail_tokens=outcome.upstream_tail_tokens,
        upstream_stop_ms=outcome.upstream_stop_ms,
        ttft_s=_round(outcome.ttft_s),
        e2e_s=_round(outcome.e2e_s),
    )


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def usage_record(outcome: RunOutcome, price: Price | None = None) -> UsageRecord:
    """The run's usage record; `cost` at `price`, the served model's (None: it has none), the
    tail included in the generated tokens (the upstream produced them)."""
    prompt = outcome.prompt_tokens or 0
    return UsageRecord(
        run_id=outcome.run_id,
        tenant=outcome.tenant,
        principal=outcome.principal,
        model=outcome.model,
        status=PUBLIC_STATUS[outcome.status],
        finish_reason=outcome.finish_reason,
        cancel_source=outcome.cancel_source,
        prompt_tokens=prompt,
        generated_tokens=outcome.generated_tokens,
        sent_tokens=outcome.sent_tokens,
        tail_tokens=outcome.tail_tokens,
        ttft_s=outcome.ttft_s,
        e2e_s=outcome.e2e_s,
        ended_at=time.time(),
        cost=None if price is None else price.cost(prompt, outcome.generated_tokens),
    )
