"""A tenant's `budget_cost`: money per budget period, charged at the model's price, refused as
the token budget is (429 `insufficient_quota`), on both stores and a fake clock."""

from __future__ import annotations

import pytest

from policies.quotas import NANOS, QuotaLimits, QuotaRequest, nanos
from tests.unit.test_quotas import clock, refused, store  # noqa: F401 (fixtures)

_runs = iter(range(1_000_000))
LIMITS = QuotaLimits(budget_cost=1.0, budget_period=3600.0)  # 1.00 per hour


def costing(cost: float, tokens: int = 10, limits: QuotaLimits = LIMITS) -> QuotaRequest:
    return QuotaRequest("acme", f"run-{next(_runs)}", tokens, limits, cost=nanos(cost))


def test_money_is_counted_in_exact_billionths():
    assert nanos(0.1 + 0.2) == 300_000_000  # float noise is not a billionth more
    assert nanos(1e-10) == 1  # a cost is never rounded down to nothing
    assert NANOS == 1_000_000_000


async def test_budget_cost_is_insufficient_quota_until_the_period_ends(store, clock):  # noqa: F811
    first = await store.admit(costing(0.6))
    error = await refused(store, costing(0.5))
    assert (error.limit, error.code) == ("budget_cost", "insufficient_quota")
    assert error.retry_after == pytest.approx(3600 - 1180)  # the token budget's periods
    assert error.headers["retry-after"] == "2420"
    assert "Cost budget exceeded: 1 per 1h0m0s" in error.message
    assert "0.6 spent" in error.message and "0.5 reserved" in error.message
    await store.release(first, used_tokens=5, used_cost=nanos(0.2))  # it cost less: refunded
    await store.admit(costing(0.5))
    await refused(store, costing(0.31))
    clock.advance(3600 - 1180)  # the next period starts afresh
    await store.admit(costing(1.0))


async def test_a_spent_budget_refuses_a_run_whose_cost_is_unknown_up_front(store):  # noqa: F811
    first = await store.admit(costing(0.0))  # a model alias: reserved at 0
    await store.release(first, used_tokens=5, used_cost=nanos(0.7))
    await store.admit(costing(0.0))  # 0.7 of 1.0 spent: still some left
    second = await store.admit(costing(0.0))
    await store.release(second, used_tokens=5, used_cost=nanos(0.3))
    error = await refused(store, costing(0.0))  # all of it spent
    assert error.limit == "budget_cost"


async def test_a_run_above_the_whole_budget_can_never_pass(store):  # noqa: F811
    error = await refused(store, costing(1.5))
    assert error.limit == "budget_cost"
    await store.admit(costing(1.0))  # it consumed nothing


async def test_the_token_and_cost_budgets_hold_together(store):  # noqa: F811
    both = QuotaLimits(budget_tokens=100, budget_cost=1.0, budget_period=3600.0)
    first = await store.admit(costing(0.1, tokens=90, limits=both))
    assert (await refused(store, costing(0.1, tokens=20, limits=both))).limit == "budget"
    await store.release(first, used_tokens=10, used_cost=nanos(0.95))
    assert (await refused(store, costing(0.1, tokens=20, limits=both))).limit == "budget_cost"


async def test_a_release_is_idempotent_for_the_cost_too(store):  # noqa: F811
    first = await store.admit(costing(0.5))
    await store.release(first, used_tokens=5, used_cost=nanos(0.1))
    await store.release(first, used_tokens=5, used_cost=nanos(0.9))  # no second charge
    await store.admit(costing(0.9))
