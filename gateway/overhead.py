"""`sluice_gateway_overhead_seconds{phase}`: the time the gateway itself adds to a run.

`request`: from the request's arrival to the upstream request being sent, plus from the
upstream's last event to the run's terminal state recorded (one observation per run).
`chunk`: from a batch of events arriving from the upstream to its chunks being in the run's
log, where streams and followers read them (one observation per batch).
Neither includes time spent generating, waiting for capacity or in a client's socket.

NOTE: timing every batch costs two perf_counter() calls and a bisect, well under a microsecond;
bench/gateway_overhead.py (64 streams, no delay) showed no difference in CPU per chunk beyond
its run-to-run noise, so no batch is skipped.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric

from gateway.metric_labels import OVERHEAD_PHASES

NAME = "sluice_gateway_overhead_seconds"
DOC = (
    "Time the gateway adds, by phase: request (arrival to the upstream request sent, plus the "
    "upstream's last event to the run recorded ended), chunk (a batch from the upstream to its "
    "chunks in the run's log)."
)


class Phase:
    """One phase's buckets: plain counters, updated on the event loop only (no lock)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class OverheadHistogram:
    """The collector: both phases, exported from the start."""

    def __init__(self, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.request = Phase(buckets)
        self.chunk = Phase(buckets)
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(NAME, DOC, labels=["phase"])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(NAME, DOC, labels=["phase"])
        for name, phase in zip(OVERHEAD_PHASES, (self.request, self.chunk), strict=True):
            cumulative, running = [], 0
            for bound, count in zip([*phase.bounds, float("inf")], phase.counts, strict=True):
                running += count
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric([name], cumulative, sum_value=phase.sum)
        yield family


class RunOverhead:
    """One run's marks on `time.monotonic()` (the clock of the request's arrival); its batches
    are timed on `time.perf_counter()`."""

    __slots__ = ("arrived", "clock", "histogram", "sent_at", "upstream_done_at", "waited")

    def __init__(
        self,
        histogram: OverheadHistogram,
        arrived: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.histogram = histogram
        self.clock = clock
        self.arrived = arrived
        self.waited = 0.0  # in the fair queue, for capacity: not the gateway's own time
        self.sent_at: float | None = None
        self.upstream_done_at: float | None = None

    def sent(self, at: float | None = None) -> None:
        """The request goes to the backend's adapter now (or went, `at`)."""
        self.sent_at = self.clock() if at is None else at

    def upstream_done(self) -> None:
        self.upstream_done_at = self.clock()

    def ended(self, terminal_at: float | None) -> None:
        """The run is settled: its request overhead, once, if it reached a backend. A run
        stopped early has its ending recorded before the backend is done: only the part
        before the backend counts then."""
        if self.sent_at is None:
            return
        before = max(0.0, self.sent_at - self.arrived - self.waited)
        after = 0.0
        if terminal_at is not None and self.upstream_done_at is not None:
            after = max(0.0, terminal_at - self.upstream_done_at)
        self.histogram.request.observe(before + after)
        self.sent_at = None  # once

    def batch_done(self, started: float) -> None:
        """A batch that arrived at `started` (perf_counter) is in the run's log."""
        self.histogram.chunk.observe(time.perf_counter() - started)
