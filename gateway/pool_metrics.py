"""The pools' members in Prometheus (design §7): read from the pools when scraped, so the
routing path only bumps plain counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from adapters.pool import PoolAdapter

MIGRATION_OUTCOMES = ("continued", "failed", "not_continuable")

_COUNTERS = {
    "routed": "Requests routed to the pool member.",
    "failures": "Requests the member failed before their first event (then retried elsewhere).",
    "ejections": "Times the member was taken out of routing (a failed request, a stall).",
    "stalls": "Times the member had work and took no engine step for --stall-timeout.",
}


class PoolCollector:
    def __init__(self, pools: list[PoolAdapter]) -> None:
        self.pools = pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "member"]
        counters = {
            k: CounterMetricFamily(f"sluice_pool_member_{k}", doc, labels=labels)
            for k, doc in _COUNTERS.items()
        }
        in_flight = GaugeMetricFamily(
            "sluice_pool_member_in_flight",
            "This gateway's requests streaming from it.",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "sluice_pool_member_healthy", "1 while the member is routed to.", labels=labels
        )
        affinity = CounterMetricFamily(
            "sluice_pool_affinity_routes",
            "Requests sent by prefix affinity to a member other than the least loaded.",
            labels=["pool"],
        )
        hit_ratio = GaugeMetricFamily(
            "sluice_pool_member_prefix_cache_hit_ratio",
            "The member's prefix-cache hits per lookup, as it reports them (our own workers).",
            labels=labels,
        )
        migrations = CounterMetricFamily(
            "sluice_run_migrations",
            "Runs whose member failed mid-stream, by outcome: continued on another member, "
            "failed (no member could take it), not_continuable (several choices, or a member "
            "that cannot continue a run, such as an OpenAI-compatible server).",
            labels=["pool", "outcome"],
        )
        for pool in self.pools:
            for row in pool.snapshot():
                key = [pool.name, row["member"]]
                for name, family in counters.items():
                    family.add_metric(key, row[name])
                in_flight.add_metric(key, row["in_flight"])
                healthy.add_metric(key, int(row["healthy"]))
                if row["prefix_hit_ratio"] is not None:
                    hit_ratio.add_metric(key, row["prefix_hit_ratio"])
            affinity.add_metric([pool.name], pool.affinity_routes)
            for outcome in MIGRATION_OUTCOMES:
                migrations.add_metric([pool.name, outcome], pool.migrations[outcome])
        yield from counters.values()
        yield in_flight
        yield healthy
        yield affinity
        yield hit_ratio
        yield migrations
