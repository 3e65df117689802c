"""Gateway metrics (DESIGN §7), on a registry owned by the app rather than a global one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class GatewayMetrics:
    """Every gateway metric, created once per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
        self.ttft = Histogram(
            "sluice_ttft_seconds",
            "Request received to first token sent.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "sluice_inter_token_seconds",
            "Gap between consecutive streamed tokens.",
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sluice_e2e_seconds",
            "Request received to response complete.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "sluice_tokens_total",
            "Tokens by kind: prompt, generated, sent, tail.",
            ["kind"],
            registry=r,
        )
        self.active_streams = Gauge(
            "sluice_active_streams", "Streaming responses open now.", registry=r
        )
        self.disconnects = Counter(
            "sluice_disconnects_total",
            "Clients that went away before their response ended.",
            registry=r,
        )
