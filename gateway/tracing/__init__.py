"""Traces of runs (`--otlp-endpoint`, docs/tracing.md): one span per run after the GenAI
semantic conventions, its worker's span a child of it.

This package's surface is light on purpose: the run code holds a `RunTrace` or None and calls
it only when it is there; OpenTelemetry itself loads in run_trace.py, imported when tracing is
turned on (gateway/tracing/setup.py), so a gateway without the flag never imports it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.runs.accounting import RunAccounting
    from gateway.runs.spec import RunOutcome, RunSpec

Settle = Callable[["RunOutcome"], Awaitable[None]]


class RunTrace(Protocol):
    """One run's span: started when the run starts, ended with its outcome."""

    traceparent: str

    def start(self, spec: RunSpec, settle: Settle | None) -> Settle:
        """Open the span (backdated to the request's arrival), once; the returned settle ends
        it."""
        ...

    def abandon(self, error: str) -> None:
        """End a span opened for a run that never started (its opening failed after its
        upstream call had left), as an error of type `error`."""
        ...

    def attach(self, acct: RunAccounting) -> dict[str, str] | None:
        """Read the run's counters at its end; the exemplar its histograms carry (None when
        the trace is not sampled)."""
        ...

    def event(self, name: str, **attributes: str | int) -> None: ...


class RunTracer(Protocol):
    def prepare(
        self, headers: Mapping[str, str], content: bool, body: Mapping[str, Any]
    ) -> RunTrace:
        """A run's trace, not yet started: the caller's `traceparent` as its parent, whether
        its tenant opted into content (`trace_content`), the fields the request gave."""
        ...

    async def close(self) -> None: ...
