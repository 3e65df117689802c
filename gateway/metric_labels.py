"""Every label value the gateway's counters can take, known before any request: one table.

A counter is exported at 0 from the start of the process for each combination below, so a
dashboard's `rate()` and an alert's `increase()` see the series before its first event rather
than a gap (design §7). Labels whose values only the run time knows (`model`, `tenant`, `alias`,
`pool`, `member`) are not in a row: their series are created for the values the process knows
at start (the catalog's models, the tenants file's tenants, the config's aliases, the pools'
members) and never invented. `sluice_requests_total{model,tenant,code}` and
`sluice_local_worker_exits_total{member,reason}` have no row: a `code` is whatever status a
request was answered with, a `reason` whatever code or signal a worker exited with.

Code that counts takes its label values from here (or from the constants named here), and
tests/unit/test_metric_labels.py fails on a literal label value that is not in this table.
"""

from __future__ import annotations

from adapters.events import FINISH_REASONS
from adapters.fallback_route import OUTCOMES as FALLBACK_OUTCOMES
from adapters.pool_members import EJECTION_REASONS
from adapters.retry_budget import REFUSED, RETRY_REASONS
from policies.quotas import LIMITS as QUOTA_LIMITS
from wire.share import TIERS

TOKEN_KINDS = ("prompt", "generated", "sent", "tail")
# a run's finish reason, or for one that did not complete the status it ended in
RUN_END_REASONS = (*sorted(FINISH_REASONS), "cancelled", "timeout", "error", "rejected")
# what stopped a run early: a client's cancel, its client gone, a deadline, a safety block,
# the store away past its grace, another replica ended it, a drain's time up
CANCEL_SOURCES = ("client", "disconnect", "timeout", "safety", "store", "lost", "shutdown")
CANCEL_OUTCOMES = ("clean", "tail", "unconfirmed")
RESUME_OUTCOMES = ("live", "replayed", "expired", "not_found")
# a tenant's limits (policies/quotas.py), and `model`: a model the tenant may not use
REJECTION_LIMITS = (*QUOTA_LIMITS, "model")
DEADLINES = ("queue", "ttft", "inter_token", "total")
SAFETY_ACTIONS = ("redact", "block", "checker_error")
MIGRATION_OUTCOMES = ("continued", "failed", "not_continuable")
RETRY_LABELS = (*RETRY_REASONS, REFUSED)
OVERHEAD_PHASES = ("request", "chunk")
# a run's upstream request sent before its opening was back (Redis): kept for the run, or
# closed because the opening refused (a guess at the tenant's headroom missed) or failed
EARLY_OUTCOMES = ("kept", "closed")

# family (as the text format names it: a counter without `_total`) → its known labels' values
KNOWN: dict[str, dict[str, tuple[str, ...]]] = {
    "sluice_runs_finished": {"reason": RUN_END_REASONS},
    "sluice_tokens": {"kind": TOKEN_KINDS},
    "sluice_deadlines_exceeded": {"deadline": DEADLINES},
    "sluice_cancellations": {"source": CANCEL_SOURCES, "outcome": CANCEL_OUTCOMES},
    "sluice_disconnects": {},
    "sluice_resumes": {"outcome": RESUME_OUTCOMES},
    "sluice_slow_client_detaches": {},
    "sluice_quota_rejections": {"limit": REJECTION_LIMITS},
    "sluice_idempotent_replays": {},
    "sluice_safety_actions": {"action": SAFETY_ACTIONS},
    "sluice_flow_shed": {"tier": TIERS},
    "sluice_early_upstreams": {"outcome": EARLY_OUTCOMES},
    "sluice_fallbacks": {"outcome": FALLBACK_OUTCOMES},
    "sluice_tenant_tokens_served": {},
    "sluice_tenant_cost": {},
    "sluice_local_worker_restarts": {},
    "sluice_run_migrations": {"outcome": MIGRATION_OUTCOMES},
    "sluice_member_ejections": {"reason": EJECTION_REASONS},
    "sluice_retries": {"reason": RETRY_LABELS},
}
# the families' labels only the run time knows, first in their series' label order: each value
# the process knows at start gets the row's combinations (GatewayMetrics.know_*, the pools)
RUNTIME: dict[str, str] = {
    "sluice_runs_finished": "model",  # the catalog's models
    "sluice_fallbacks": "alias",  # the config's model aliases
    "sluice_tenant_tokens_served": "tenant",  # the tenants file's tenants
    "sluice_tenant_cost": "tenant",
    "sluice_local_worker_restarts": "member",  # the local workers
    "sluice_run_migrations": "pool",  # the pools
    "sluice_member_ejections": "member",  # the pools' members
}


def combinations(row: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Every combination of a row's values, in its labels' order."""
    combos: list[tuple[str, ...]] = [()]
    for values in row.values():
        combos = [(*combo, value) for combo in combos for value in values]
    return combos
