"""What a run is asked to do, and how it ended: the values that travel with a run.

`RunSpec` is everything the run manager and the driver need to start a run (one value instead
of a dozen arguments); `RunOutcome` is one typed account of how it ended, which the metrics, the
run-end log line, the usage ledger and the idempotency key all read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adapters.base import Adapter
from adapters.requests import ChatRequest
from gateway.runs.deadlines import Deadlines
from gateway.runs.flow_control import Ticket
from gateway.runs.status import RunStatus
from gateway.state.run_store import TerminalRecord
from gateway.tracing import RunTrace
from safety.policy import SafetyPolicy


@dataclass(slots=True, frozen=True)
class RunSpec:
    run_id: str
    chat: ChatRequest
    adapter: Adapter
    tenant: str = ""
    principal: str = ""  # who to bill inside the tenant: a key id or "jwt:<sub>"
    deadlines: Deadlines = field(default_factory=Deadlines)
    started: float = 0.0  # time.monotonic() when the request was received
    safety: SafetyPolicy | None = None  # the tenant's policy, as it was when the run began
    # kept with the run record: a Responses run's fields; `background` (true) exempts the run
    # from the disconnect grace, since no client is meant to stay attached
    meta: dict[str, Any] = field(default_factory=dict)
    # its place in the backend's flow control (design §12): the driver waits for its turn, and
    # gives it back when the run no longer uses the backend; None: it goes at once
    ticket: Ticket | None = None
    # its span when tracing is on (gateway/tracing/), started with the run; None: untraced
    trace: RunTrace | None = None


@dataclass(slots=True, frozen=True)
class RunOutcome:
    """How a run ended and what it cost. Token counts: `generated` is what the upstream
    produced (tail included: what is billed), `sent` what reached the log, `tail` what came
    after the run's fate was decided and was never sent."""

    run_id: str
    tenant: str
    principal: str
    model: str
    terminal: TerminalRecord
    cancel_source: str | None  # client, disconnect, timeout, safety, store, lost, shutdown
    cancel_outcome: str | None  # clean, tail, unconfirmed
    cancel_latency_ms: float | None  # decision → the upstream's confirmed stop
    prompt_tokens: int | None  # None: the upstream never said
    generated_tokens: int
    sent_tokens: int
    tail_tokens: int
    upstream_tail_tokens: int | None  # generated after the abort reached the upstream
    upstream_stop_ms: float | None  # abort arrival → the upstream's stop
    ttft_s: float | None
    e2e_s: float
    tail_latency_s: float | None  # last token → terminal state recorded
    safety: str | None = None  # the policy that judged its text, as `name@digest12`
    exemplar: dict[str, str] | None = None  # its sampled trace's id, for histogram exemplars

    @property
    def status(self) -> RunStatus:
        return self.terminal.status

    @property
    def finish_reason(self) -> str | None:
        return self.terminal.finish_reason
