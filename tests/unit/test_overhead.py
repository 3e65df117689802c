"""`sluice_gateway_overhead_seconds`: the gateway's own time per run (a fake clock) and per
batch, as a real run driver observes them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import OVERHEAD_BUCKETS
from gateway.overhead import OverheadHistogram, RunOverhead
from gateway.runs.status import RunStatus
from testkit.scripted_adapter import text_script
from tests.unit.test_run_driver import make_driver


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_runs_request_overhead_leaves_out_its_queue_wait_and_its_generation():
    histogram = OverheadHistogram(OVERHEAD_BUCKETS, CollectorRegistry())
    clock = FakeClock(100.0)
    run = RunOverhead(histogram, arrived=100.0, clock=clock)
    run.waited = 2.0  # in the fair queue
    clock.now = 102.003  # 2 s queued, 3 ms of the gateway's own
    run.sent()
    clock.now = 110.0  # 8 s of generation
    run.upstream_done()
    run.ended(110.001)  # 1 ms to record the ending
    run.ended(110.5)  # once only
    assert histogram.request.sum == pytest.approx(0.004)
    assert sum(histogram.request.counts) == 1
    assert sum(histogram.chunk.counts) == 0


def test_a_run_that_never_streamed_has_no_request_overhead():
    histogram = OverheadHistogram(OVERHEAD_BUCKETS, CollectorRegistry())
    RunOverhead(histogram, arrived=1.0, clock=FakeClock(1.0)).ended(2.0)
    assert sum(histogram.request.counts) == 0


def test_a_run_stopped_early_counts_only_its_part_before_the_backend():
    histogram = OverheadHistogram(OVERHEAD_BUCKETS, CollectorRegistry())
    clock = FakeClock(10.0)
    run = RunOverhead(histogram, arrived=10.0, clock=clock)
    clock.now = 10.002
    run.sent()
    run.ended(11.0)  # cancelled: its ending recorded while the backend still streams
    assert histogram.request.sum == pytest.approx(0.002)


async def test_a_driven_run_observes_its_request_once_and_every_batch_without_generation():
    _, _, driver = await make_driver(text_script(["a", "b", "c"], delay=0.1))
    outcome = await driver.start()
    assert outcome.terminal.status == RunStatus.COMPLETED
    overhead = driver.metrics.overhead
    assert sum(overhead.request.counts) == 1
    assert sum(overhead.chunk.counts) >= 3  # a batch per token at least, the usage too
    # 0.3 s of scripted generation, none of it the gateway's
    assert overhead.request.sum < 0.25 and overhead.chunk.sum < 0.25
    assert outcome.e2e_s >= 0.3
