"""The worker's Prometheus metrics (design §7), on a registry owned by one app.

Gauges and totals are read from the engine's latest stats snapshot at scrape time (a collector),
so the engine keeps plain counters and never touches prometheus; the two histograms are observed
once per step by the engine thread (prometheus_client is thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engine_outputs import EngineStats
from workers.fair_policy import PREEMPTION_REASONS

StatsSource = Callable[[], EngineStats | None]

_GAUGES = (
    ("sluice_worker_requests_running", "Requests running in the engine.", "running"),
    ("sluice_worker_requests_waiting", "Requests waiting for admission.", "waiting"),
    ("sluice_worker_kv_blocks_used", "KV cache blocks in use.", "kv_blocks_used"),
    ("sluice_worker_kv_blocks_total", "KV cache blocks in the pool.", "kv_blocks_total"),
)
_COUNTERS = (
    (
        "sluice_worker_prefix_cache_hits",
        "Prompt tokens found cached.",
        "prefix_cache_hits",
    ),
    (
        "sluice_worker_prefix_cache_queries",
        "Prompt tokens looked up.",
        "prefix_cache_queries",
    ),
    ("sluice_worker_generated_tokens", "Tokens generated.", "generated_tokens_total"),
    (
        "sluice_worker_spec_draft_tokens",
        "Prompt-lookup draft tokens verified.",
        "spec_draft_tokens",
    ),
    (
        "sluice_worker_spec_accepted_tokens",
        "Draft tokens the model agreed with (each one a step saved).",
        "spec_accepted_tokens",
    ),
)


class _StatsCollector(Collector):
    def __init__(self, source: StatsSource) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        for name, doc, attr in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(stats, attr) if stats else 0)
        for name, doc, attr in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, attr) if stats else 0)
        preemptions = CounterMetricFamily(
            "sluice_worker_preemptions",
            "Sequences preempted for recompute, by reason: kv (blocks ran out), fairness (a "
            "tenant under its share waited), priority (a higher tier waited).",
            labels=["reason"],
        )
        by_reason = stats.preemptions if stats else {}
        for reason in PREEMPTION_REASONS:
            preemptions.add_metric([reason], by_reason.get(reason, 0))
        yield preemptions


class WorkerMetrics:
    """Every `sluice_worker_*` metric, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry, source: StatsSource) -> None:
        self.registry = registry
        self.step_seconds = Histogram(
            "sluice_worker_step_seconds",
            "Wall time of one engine step.",
            # a decode step takes milliseconds; a step with a long prefill chunk on a CPU, seconds
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "sluice_worker_batch_tokens",
            "Tokens fed to the model in one step (prefill and decode).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=registry,
        )
        registry.register(_StatsCollector(source))

    def observe_step(self, seconds: float, stats: EngineStats) -> None:
        self.step_seconds.observe(seconds)
        self.batch_tokens.observe(stats.last_step_tokens)
