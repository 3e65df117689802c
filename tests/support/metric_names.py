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
        "sluice_worker_spec_draft_tokens",
        "sluice_worker_spec_accepted_tokens",
    }
)

# per pool member (the gateway's pools), labelled `member` (and `reason` for ejections)
MEMBER_METRICS = frozenset(
    {
        "sluice_member_requests",
        "sluice_member_failures",
        "sluice_member_ejections",
        "sluice_member_breaker_state",
    }
)

# The gateway's families (as the text format names them: a counter without `_total`), with their
# type and label names. Design §7 fixes the names and these labels; `sluice_run_migrations`
# also says which pool, and `sluice_store_up` (Redis answers) is the gateway's own addition.
# The `sluice_flow_*` and `sluice_tenant_*` families are fair sharing's: queues, sheds and
# each tenant's weight and tokens served; `sluice_tenant_cost` what a tenant's runs cost at the
# config's prices, and `sluice_gateway_overhead_seconds` the time the gateway itself adds.
GATEWAY_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "sluice_requests": ("counter", frozenset({"model", "tenant", "code"})),
    "sluice_runs_finished": ("counter", frozenset({"model", "reason"})),
    "sluice_ttft_seconds": ("histogram", frozenset()),
    "sluice_inter_token_seconds": ("histogram", frozenset()),
    "sluice_e2e_seconds": ("histogram", frozenset()),
    "sluice_tail_latency_seconds": ("histogram", frozenset()),
    "sluice_tokens": ("counter", frozenset({"kind"})),
    "sluice_cancellations": ("counter", frozenset({"source", "outcome"})),
    "sluice_cancel_tail_tokens": ("histogram", frozenset()),
    "sluice_cancel_latency_seconds": ("histogram", frozenset()),
    "sluice_disconnects": ("counter", frozenset()),
    "sluice_resumes": ("counter", frozenset({"outcome"})),
    "sluice_quota_rejections": ("counter", frozenset({"limit"})),
    "sluice_idempotent_replays": ("counter", frozenset()),
    "sluice_safety_actions": ("counter", frozenset({"action"})),
    "sluice_safety_hold_seconds": ("histogram", frozenset()),
    "sluice_active_streams": ("gauge", frozenset()),
    "sluice_run_migrations": ("counter", frozenset({"pool", "outcome"})),
    "sluice_member_requests": ("counter", frozenset({"member"})),
    "sluice_member_failures": ("counter", frozenset({"member"})),
    "sluice_member_ejections": ("counter", frozenset({"member", "reason"})),
    "sluice_member_breaker_state": ("gauge", frozenset({"member"})),
    "sluice_retries": ("counter", frozenset({"reason"})),
    "sluice_store_up": ("gauge", frozenset()),
    "sluice_flow_queue_depth": ("gauge", frozenset({"tenant", "tier"})),
    "sluice_flow_queue_wait_seconds": ("histogram", frozenset({"tenant", "tier"})),
    "sluice_flow_shed": ("counter", frozenset({"tier"})),
    "sluice_early_upstreams": ("counter", frozenset({"outcome"})),
    "sluice_tenant_tokens_served": ("counter", frozenset({"tenant"})),
    "sluice_tenant_weight": ("gauge", frozenset({"tenant"})),
    "sluice_tenant_cost": ("counter", frozenset({"tenant"})),
    "sluice_gateway_overhead_seconds": ("histogram", frozenset({"phase"})),
}
