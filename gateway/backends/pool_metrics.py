"""The pools' members in Prometheus (design §7): read from the pools when scraped, so the
routing path only bumps plain counters.

The contract's per-member series, `sluice_member_requests_total{member}`,
`sluice_member_failures_total{member}` and `sluice_member_ejections_total{member,reason}`, are
labelled by member only. Names are unique within a pool (adapters/pool.py `member_names`), and
each member serves one model, so one pool; a member in several pools (an adapter serving several
models) would be summed over them, never exposed twice (its `sluice_member_breaker_state`: the
worst of its breakers). The other series say which pool. `sluice_retries_total{reason}` is the
gateway's retry budget's (adapters/retry_budget.py), one for all pools.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from adapters.breaker import BreakerState
from adapters.pool import PoolAdapter
from adapters.pool_members import EJECTION_REASONS
from adapters.retry_budget import RetryBudget
from gateway.metric_labels import MIGRATION_OUTCOMES, RETRY_LABELS


def _counter(
    name: str, doc: str, labels: list[str], values: dict[tuple[str, ...], int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in values.items():
        family.add_metric(list(key), value)
    return family


class PoolCollector:
    def __init__(self, pools: list[PoolAdapter]) -> None:
        self.pools = pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._members()
        yield from self._pools()

    def _members(self) -> Iterator[Metric]:
        """The contract's series, one per member name."""
        requests: Counter[str] = Counter()
        failures: Counter[str] = Counter()
        ejections: Counter[tuple[str, str]] = Counter()
        breakers: dict[str, int] = {}
        for pool in self.pools:
            for row in pool.snapshot():
                member = row["member"]
                requests[member] += row["requests"]
                failures[member] += row["failures"]
                for reason in EJECTION_REASONS:
                    ejections[member, reason] += row["ejections"][reason]
                state = BreakerState[row["breaker"].upper()]
                breakers[member] = max(breakers.get(member, 0), state)
        yield _counter(
            "sluice_member_requests",
            "Requests sent to the pool member (a run retried or continued elsewhere counts on "
            "each member it reached).",
            ["member"],
            {(m,): n for m, n in requests.items()},
        )
        yield _counter(
            "sluice_member_failures",
            "Requests that failed on the member (unreachable, a 503, a broken connection, the "
            "member taken out), before their first event (then retried elsewhere) or "
            "mid-stream (then continued elsewhere where they can be).",
            ["member"],
            {(m,): n for m, n in failures.items()},
        )
        yield _counter(
            "sluice_member_ejections",
            "Times the member was taken out of routing, by reason: probe (it failed or did not "
            "answer its health probe), stall (it had work and its engine took no step for "
            "--stall-timeout), failure (its circuit breaker opened on failed requests).",
            ["member", "reason"],
            ejections,
        )
        breaker = GaugeMetricFamily(
            "sluice_member_breaker_state",
            "The member's circuit breaker: 0 closed (routed to), 1 half-open (one request "
            "probes it), 2 open (out of routing for a cooldown).",
            labels=["member"],
        )
        for member, state in breakers.items():
            breaker.add_metric([member], state)
        yield breaker

    def _pools(self) -> Iterator[Metric]:
        """The pool-labelled series beyond the contract's."""
        labels = ["pool", "member"]
        stalls = CounterMetricFamily(
            "sluice_pool_member_stalls",
            "Times the member had work and took no engine step for --stall-timeout.",
            labels=labels,
        )
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
            "Runs whose member failed mid-stream, by outcome: continued on another member "
            "(from the exact tokens, or from the text on an OpenAI-compatible member), failed "
            "(no member could take it), not_continuable (several choices, or a tool call or "
            "grammar half written by a member without token ids).",
            labels=["pool", "outcome"],
        )
        for pool in self.pools:
            for row in pool.snapshot():
                key = [pool.name, row["member"]]
                stalls.add_metric(key, row["stalls"])
                in_flight.add_metric(key, row["in_flight"])
                healthy.add_metric(key, int(row["healthy"]))
                if row["prefix_hit_ratio"] is not None:
                    hit_ratio.add_metric(key, row["prefix_hit_ratio"])
            affinity.add_metric([pool.name], pool.affinity_routes)
            for outcome in MIGRATION_OUTCOMES:
                migrations.add_metric([pool.name, outcome], pool.migrations[outcome])
        yield stalls
        yield in_flight
        yield healthy
        yield affinity
        yield hit_ratio
        yield migrations


class RetryCollector:
    """`sluice_retries_total{reason}`: the retries the gateway's budget allowed, by why the
    attempt before failed, and those it refused (`budget_exhausted`); every reason from 0."""

    def __init__(self, budget: RetryBudget) -> None:
        self.budget = budget

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counts = self.budget.counts
        yield _counter(
            "sluice_retries",
            "Retries of requests that failed before their first event, by reason: unavailable "
            "(unreachable, a 503), rate_limited (a 429), failed (a 5xx, a broken or malformed "
            "stream, the member taken out), fallback (a model alias's next target); "
            "budget_exhausted counts the retries the retry budget refused.",
            ["reason"],
            {(reason,): counts[reason] for reason in RETRY_LABELS},
        )
