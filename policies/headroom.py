"""Whether a tenant is far enough from its limits that its next admission will all but surely pass.

On Redis a run's admission is a round trip, and a run whose opening can refuse nothing sends
its upstream request before that round trip is back (gateway/runs/life.py). A tenant with limits
can be refused, but one far from all of them almost never is: judged from the usage its last
admission on this replica reported, with the openings this replica has in flight since counted
as admitted, and a share of every limit (`MARGIN`) kept for what other replicas admit meanwhile.
A guess that misses costs an upstream request begun and closed at once; the refusal itself is
decided by the store as always, so no limit ever holds less exactly.

The usage is as fresh as the tenant's last opening: an idle tenant's first request (after
`FRESH` seconds), and any after a refusal, wait for the round trip.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from policies.quotas import US, QuotaLimits, QuotaRequest, Snapshot, budget_period, nanos

MARGIN = 0.25  # the share of each limit a guess leaves for other replicas' admissions
FRESH = 2.0  # seconds a tenant's reported usage is judged by
PRUNE_AT = 64  # tenants kept before the stale are swept out


class Headroom:
    """Per tenant: the usage its latest admission reported, and this replica's openings since."""

    def __init__(
        self, clock: Callable[[], float] = time.time, margin: float = MARGIN, fresh: float = FRESH
    ) -> None:
        self.clock = clock
        self.keep = 1.0 - margin
        self.fresh = fresh
        # tenant → its usage after its latest admission here, that run included
        self._usage: dict[str, Snapshot] = {}
        self._in_flight: dict[str, list[int]] = {}  # tenant → [runs, tokens, cost]
        self._prune_at = PRUNE_AT

    def roomy(self, request: QuotaRequest) -> bool:
        """Whether `request`, with this replica's openings in flight, stays within every
        limit's kept share by the tenant's latest reported usage."""
        usage = self._usage.get(request.tenant)
        if usage is None:
            return False
        lim = request.limits
        now = round(self.clock() * US)
        if now - usage.now_us > self.fresh * US:
            return False
        runs, tokens, cost = self._in_flight.get(request.tenant, (0, 0, 0))
        runs, tokens, cost = runs + 1, tokens + request.tokens, cost + request.cost
        return (
            self._fits(usage.requests + runs, lim.rpm)
            and self._fits(usage.tokens + tokens, lim.tpm)
            and self._fits(usage.live + runs, lim.max_concurrent)
            and self._within_budgets(usage, lim, now, tokens, cost)
        )

    def opening(self, request: QuotaRequest) -> None:
        """An admission of this replica's is on its way: counted as taken until it answers."""
        flight = self._in_flight.setdefault(request.tenant, [0, 0, 0])
        flight[0] += 1
        flight[1] += request.tokens
        flight[2] += request.cost

    def answered(self, request: QuotaRequest, usage: Snapshot | None) -> None:
        """That admission's answer: the usage it reported (None: it was refused, or failed,
        and the tenant's next opening waits for its own answer)."""
        flight = self._in_flight[request.tenant]
        flight[0] -= 1
        flight[1] -= request.tokens
        flight[2] -= request.cost
        if flight[0] == 0:
            del self._in_flight[request.tenant]
        if usage is None:
            self._usage.pop(request.tenant, None)
            return
        seen = self._usage.get(request.tenant)
        if seen is None or usage.now_us >= seen.now_us:
            self._usage[request.tenant] = usage
        if len(self._usage) > self._prune_at:
            self._forget_stale(usage.now_us)

    def _fits(self, used: int, limit: int | None) -> bool:
        return limit is None or used <= limit * self.keep

    def _within_budgets(
        self, usage: Snapshot, lim: QuotaLimits, now: int, tokens: int, cost: int
    ) -> bool:
        period = budget_period(now, lim)
        if period is None:
            return True
        if budget_period(usage.now_us, lim) != period:  # reported in a period now over
            return False
        if lim.budget_cost is not None and not self._fits(
            usage.cost_used + cost, nanos(lim.budget_cost)
        ):
            return False
        return self._fits(usage.budget_used + tokens, lim.budget_tokens)

    def _forget_stale(self, now_us: int) -> None:
        """Usage older than `fresh` judges nothing: it goes, once the kept tenants have doubled
        since the last sweep (so a sweep's cost is shared by as many answers)."""
        cutoff = now_us - self.fresh * US
        for tenant in [t for t, u in self._usage.items() if u.now_us < cutoff]:
            del self._usage[tenant]
        self._prune_at = max(PRUNE_AT, 2 * len(self._usage))
