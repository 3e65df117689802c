"""Gateway metrics (design §7), on a registry owned by the app rather than a global one."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Exemplar, HistogramMetricFamily, Metric

from adapters.fallback_route import OUTCOMES
from gateway.metric_labels import KNOWN, SAFETY_ACTIONS, combinations
from gateway.overhead import OverheadHistogram
from policies.tenants import Tenant

# NOTE: LLM latencies span five orders of magnitude: a cached short answer's first token in a
# millisecond or two, a long generation (or a queue under load) in minutes, up to the default
# --total-timeout. The buckets cover 1 ms to 10 min, so a p99 is never clamped to the last bound.
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
# Gaps between tokens (and a cancel's confirmation): milliseconds when healthy, up to the
# default --inter-token-timeout (60 s) when a worker stalls.
TOKEN_GAP_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60),
)
TAIL_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# The gateway's own work per request and per chunk: tens of microseconds when healthy, up to
# the event loop stalling for a second or more.
OVERHEAD_BUCKETS = (
    *(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005),
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)


class LoopHistogram:
    """A histogram for code that runs on one event loop: plain counters, no locks.

    NOTE: prometheus_client's Histogram takes a lock per observation; the gateway observes one
    inter-token gap per streamed token, all on the event loop thread, so the lock is pure cost.
    The exposition is the standard histogram family.
    """

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        # per bucket, the latest traced observation (OpenMetrics exemplars; docs/tracing.md)
        self.exemplars: list[Exemplar | None] = [None] * len(self.counts)
        registry.register(self)

    def observe(self, value: float, exemplar: dict[str, str] | None = None) -> None:
        """`exemplar`: the labels (`trace_id`) of a sampled run's trace, None when untraced."""
        bucket = bisect_left(self.bounds, value)
        self.counts[bucket] += 1
        self.sum += value
        if exemplar is not None:
            self.exemplars[bucket] = Exemplar(exemplar, value, time.time())

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        cumulative: list = []
        running = 0
        bounds = [*self.bounds, float("inf")]
        for bound, count, exemplar in zip(bounds, self.counts, self.exemplars, strict=True):
            running += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            cumulative.append((label, running) if exemplar is None else (label, running, exemplar))
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=cumulative, sum_value=self.sum
        )


class GatewayMetrics:
    """Every gateway metric, created once per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._run_metrics(self.registry)
        self._cancel_metrics(self.registry)
        self._client_metrics(self.registry)
        self._tenant_metrics(self.registry)
        self._flow_metrics(self.registry)
        self._process_metrics(self.registry)
        self._zero()

    def _run_metrics(self, r: CollectorRegistry) -> None:
        """What runs took and produced."""
        self.requests = Counter(
            "sluice_requests_total",
            "HTTP API requests by answer code.",
            ["model", "tenant", "code"],
            registry=r,
        )
        self.runs_finished = Counter(
            "sluice_runs_finished_total",
            "Runs that reached a terminal state, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.ttft = LoopHistogram(
            "sluice_ttft_seconds", "Request received to first token sent.", LATENCY_BUCKETS, r
        )
        self.inter_token = LoopHistogram(
            "sluice_inter_token_seconds",
            "Gap between consecutive streamed tokens.",
            TOKEN_GAP_BUCKETS,
            r,
        )
        self.e2e = LoopHistogram(
            "sluice_e2e_seconds", "Request received to response complete.", LATENCY_BUCKETS, r
        )
        self.tokens = Counter(
            "sluice_tokens_total",
            "Tokens by kind: prompt, generated, sent, tail.",
            ["kind"],
            registry=r,
        )
        self.tail_latency = LoopHistogram(
            "sluice_tail_latency_seconds",
            "Last token received to the run's terminal state recorded.",
            TOKEN_GAP_BUCKETS,
            r,
        )
        self.overhead = OverheadHistogram(OVERHEAD_BUCKETS, r)
        self.deadlines = Counter(
            "sluice_deadlines_exceeded_total",
            "Runs ended by a deadline, by which one (queue, ttft, inter_token, total).",
            ["deadline"],
            registry=r,
        )

    def _cancel_metrics(self, r: CollectorRegistry) -> None:
        """How well early stops worked."""
        self.cancellations = Counter(
            "sluice_cancellations_total",
            "Runs stopped early, by source (client, disconnect, timeout, safety, store, lost, "
            "shutdown) and outcome (clean: no token after the cancel; tail: some; unconfirmed: "
            "never confirmed).",
            ["source", "outcome"],
            registry=r,
        )
        self.cancel_tail_tokens = LoopHistogram(
            "sluice_cancel_tail_tokens",
            "Tokens generated after a cancel decision (never sent), per cancelled run.",
            TAIL_TOKEN_BUCKETS,
            r,
        )
        self.cancel_latency = LoopHistogram(
            "sluice_cancel_latency_seconds",
            "Cancel decision to the upstream's confirmed stop.",
            TOKEN_GAP_BUCKETS,
            r,
        )

    def _client_metrics(self, r: CollectorRegistry) -> None:
        """The clients' side: streams, disconnects, resumes, slow readers."""
        self.active_streams = Gauge(
            "sluice_active_streams", "Streaming responses open now.", registry=r
        )
        self.disconnects = Counter(
            "sluice_disconnects_total",
            "Clients that went away before their response ended.",
            registry=r,
        )
        self.resumes = Counter(
            "sluice_resumes_total",
            "Stream resumes by outcome (live, replayed, expired, not_found).",
            ["outcome"],
            registry=r,
        )
        self.client_blocked = LoopHistogram(
            "sluice_client_blocked_seconds",
            "Per stream, the time spent waiting for a slow client to take bytes (not "
            "generation time).",
            LATENCY_BUCKETS,
            r,
        )
        self.slow_clients = Counter(
            "sluice_slow_client_detaches_total",
            "Streams detached because the client stayed unwritable past the limit.",
            registry=r,
        )

    def _tenant_metrics(self, r: CollectorRegistry) -> None:
        """Tenant policies at work."""
        self.quota_rejections = Counter(
            "sluice_quota_rejections_total",
            "Requests refused by a tenant limit (requests, tokens, concurrency, budget, model).",
            ["limit"],
            registry=r,
        )
        self.early_upstreams = Counter(
            "sluice_early_upstreams_total",
            "Upstream requests sent before the run's opening was back from Redis, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.idempotent_replays = Counter(
            "sluice_idempotent_replays_total",
            "Requests answered from the run an earlier request with the same key started.",
            registry=r,
        )
        actions = Counter(
            "sluice_safety_actions_total",
            "What safety windows did: spans redacted, runs blocked, checkers that failed.",
            ["action"],
            registry=r,
        )
        hold = LoopHistogram(
            "sluice_safety_hold_seconds",
            "How long released text waited in a safety window (per upstream delta).",
            HOLD_BUCKETS,
            r,
        )
        self.safety = SafetyMeter(actions, hold)

    def _flow_metrics(self, r: CollectorRegistry) -> None:
        """Fair sharing at work (design §12): queues, sheds, who got served; and where model
        aliases sent their requests (design §6). `tenant` is a name the tenants file gives,
        `alias` one the config file does, so the labels stay bounded."""
        self.queue_depth = Gauge(
            "sluice_flow_queue_depth",
            "Runs waiting for capacity in this replica's fair queues, by tenant and tier.",
            ["tenant", "tier"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "sluice_flow_queue_wait_seconds",
            "Time a run waited for capacity in this replica (0: dispatched at once).",
            ["tenant", "tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "sluice_fallbacks_total",
            "Requests for a model alias by how its route ended: served_first (its first target "
            "served), fell_back (a later one did), exhausted (none could).",
            ["alias", "outcome"],
            registry=r,
        )
        self.shed = Counter(
            "sluice_flow_shed_total",
            "Runs refused (429) or evicted because their tenant's queue was full, by tier.",
            ["tier"],
            registry=r,
        )
        self.tokens_served = Counter(
            "sluice_tenant_tokens_served_total",
            "Tokens generated for a tenant's runs (counted as each run ends).",
            ["tenant"],
            registry=r,
        )
        self.tenant_weight = Gauge(
            "sluice_tenant_weight",
            "A tenant's weight in the tenants file: its share of a saturated pool, relative.",
            ["tenant"],
            registry=r,
        )
        self.tenant_cost = Counter(
            "sluice_tenant_cost",
            "What a tenant's runs cost at the config's [prices] (in the prices' currency), "
            "counted as each run of a priced model ends.",
            ["tenant"],
            registry=r,
        )

    def know_tenants(self, tenants: Iterable[Tenant]) -> None:
        """Export every named tenant's series from the start (at 0), and its weight; called at
        start and on each reload of the tenants file."""
        for tenant in tenants:
            self.tenant_weight.labels(tenant.name).set(tenant.sharing.weight)
            self.tokens_served.labels(tenant.name)
            self.tenant_cost.labels(tenant.name)
            for tier in tenant.sharing.tiers:
                self.queue_depth.labels(tenant.name, tier)

    def know_models(self, models: Iterable[str]) -> None:
        """Export every served model's run endings from the start (at 0)."""
        for model in models:
            for combo in combinations(KNOWN["sluice_runs_finished"]):
                self.runs_finished.labels(model, *combo)

    def know_workers(self, names: Iterable[str]) -> None:
        """Export every local worker's restarts from the start (at 0)."""
        for name in names:
            self.local_worker_restarts.labels(name)

    def _zero(self) -> None:
        """Every series whose label values are all known up front (gateway/metric_labels.py),
        at 0 from the start."""
        fixed = {
            "sluice_tokens": self.tokens,
            "sluice_deadlines_exceeded": self.deadlines,
            "sluice_cancellations": self.cancellations,
            "sluice_resumes": self.resumes,
            "sluice_quota_rejections": self.quota_rejections,
            "sluice_flow_shed": self.shed,
            "sluice_early_upstreams": self.early_upstreams,
        }
        for name, counter in fixed.items():
            for combo in combinations(KNOWN[name]):
                counter.labels(*combo)

    def know_aliases(self, aliases: Iterable[str]) -> None:
        """Export every model alias's series from the start (at 0)."""
        for alias in aliases:
            for outcome in OUTCOMES:
                self.fallbacks.labels(alias, outcome)

    def _process_metrics(self, r: CollectorRegistry) -> None:
        """The gateway process: its local workers and what it holds in memory."""
        self.local_worker_exits = Counter(
            "sluice_local_worker_exits_total",
            "Local worker processes that exited unasked, by member and reason (code:N, signal:X; "
            "start_failed: a restart that did not come up).",
            ["member", "reason"],
            registry=r,
        )
        self.local_worker_restarts = Counter(
            "sluice_local_worker_restarts_total",
            "Local worker processes started again after an exit (each attempt, whether it came "
            "up or not), by member.",
            ["member"],
            registry=r,
        )
        self.local_worker_crash_looping = Gauge(
            "sluice_local_worker_crash_looping",
            "1 while a local worker keeps exiting soon after each restart.",
            ["member"],
            registry=r,
        )
        self.store_up = Gauge(
            "sluice_store_up",
            "1 while the shared state store (Redis) answers, as this replica's client last saw "
            "it (its lease renewal asks every few seconds); always 1 with the in-process store.",
            registry=r,
        )
        self.retained_bytes = Gauge(
            "sluice_retained_bytes",
            "Bytes held in this process for runs (their events and endings, live and ended) "
            "and for the endings kept with idempotency keys.",
            ["what"],
            registry=r,
        )


class SafetyMeter:
    """What the safety window reports, with the counters' children bound once (the window
    observes a hold per streamed delta)."""

    __slots__ = ("_actions", "_hold")

    def __init__(self, actions: Counter, hold: LoopHistogram) -> None:
        self._actions = {a: actions.labels(a) for a in SAFETY_ACTIONS}
        self._hold = hold

    def action(self, action: str) -> None:
        self._actions[action].inc()

    def held(self, seconds: float) -> None:
        self._hold.observe(seconds)
