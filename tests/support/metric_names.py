"""Metric names fixed by design §7, spelled out once for the tests that check them."""

WORKER_METRICS = frozenset(
    {
        "sluice_worker_requests_running",
        "sluice_worker_requests_waiting",
        "sluice_worker_kv_blocks_used",
        "sluice_worker_kv_blocks_total",
        "sluice_worker_prefix_cache_hits",
        "sluice_worker_prefix_cache_queries",
        "sluice_worker_preemptions",
        "sluice_worker_step_seconds",
        "sluice_worker_batch_tokens",
        "sluice_worker_generated_tokens",
    }
)

# per pool member (the gateway's pools), labelled `member` (and `reason` for ejections)
MEMBER_METRICS = frozenset(
    {
        "sluice_member_requests",
        "sluice_member_failures",
        "sluice_member_ejections",
    }
)
