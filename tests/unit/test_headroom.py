"""A replica's judgement of a tenant's headroom (policies/headroom.py): whether a run may go
upstream before its admission is back. Only a tenant far from every limit by its latest
reported usage, with this replica's openings in flight counted, is judged roomy."""

from __future__ import annotations

import pytest

from policies.headroom import FRESH, MARGIN, Headroom
from policies.quotas import US, QuotaLimits, QuotaRequest, Snapshot, nanos
from tests.unit.test_quotas import START, FakeClock


def request(tokens: int = 10, cost: int = 0, tenant: str = "acme", **limits) -> QuotaRequest:
    return QuotaRequest(tenant, "run", tokens, QuotaLimits(**limits), cost)


def usage(clock: FakeClock, **used) -> Snapshot:
    return Snapshot(round(clock.now * US), **used)


def seen(headroom: Headroom, clock: FakeClock, asked: QuotaRequest, **used) -> None:
    """An admission of `asked` answered with `used` as the tenant's usage."""
    headroom.opening(asked)
    headroom.answered(asked, usage(clock, **used))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_tenant_never_seen_is_not_roomy(clock):
    assert not Headroom(clock).roomy(request(rpm=100))


@pytest.mark.parametrize(
    ("limits", "used", "asked"),
    [
        ({"rpm": 100}, {"requests": 74}, {}),
        ({"tpm": 1000}, {"tokens": 740}, {"tokens": 10}),
        ({"max_concurrent": 8}, {"live": 5}, {}),
        ({"budget_tokens": 1000, "budget_period": 3600.0}, {"budget_used": 740}, {"tokens": 10}),
        (
            {"budget_cost": 1.0, "budget_period": 3600.0},
            {"cost_used": nanos(0.7)},
            {"cost": nanos(0.05)},
        ),
    ],
    ids=["rpm", "tpm", "concurrency", "budget", "budget_cost"],
)
def test_each_limit_keeps_its_margin(clock, limits, used, asked):
    """Roomy up to (1 - MARGIN) of the limit with this run counted; not one unit past it."""
    assert MARGIN == 0.25
    headroom = Headroom(clock)
    seen(headroom, clock, request(**limits), **used)
    assert headroom.roomy(request(**asked, **limits))
    name, value = next(iter(used.items()))
    seen(headroom, clock, request(**limits), **{name: value + 1})
    assert not headroom.roomy(request(**asked, **limits))


def test_openings_in_flight_count_as_admitted(clock):
    headroom = Headroom(clock)
    limits = {"rpm": 8}  # roomy while requests + in flight + this one <= 6
    seen(headroom, clock, request(**limits), requests=3)
    in_flight = [request(**limits) for _ in range(3)]
    for asked in in_flight:
        assert headroom.roomy(asked)
        headroom.opening(asked)
    assert not headroom.roomy(request(**limits))  # 3 + 3 in flight + 1 > 6
    # one answers: 3 with it (one admission left the window meanwhile), 2 still in flight
    headroom.answered(in_flight[0], usage(clock, requests=3))
    assert headroom.roomy(request(**limits))


def test_a_refusal_or_a_failure_forgets_the_tenant(clock):
    headroom = Headroom(clock)
    seen(headroom, clock, request(rpm=100), requests=1)
    asked = request(rpm=100)
    headroom.opening(asked)
    headroom.answered(asked, None)
    assert not headroom.roomy(request(rpm=100))


def test_usage_older_than_fresh_judges_nothing(clock):
    headroom = Headroom(clock)
    seen(headroom, clock, request(rpm=100), requests=1)
    clock.advance(FRESH)
    assert headroom.roomy(request(rpm=100))
    clock.advance(0.001)
    assert not headroom.roomy(request(rpm=100))


def test_an_older_answer_does_not_replace_a_newer_one(clock):
    headroom = Headroom(clock)
    early = usage(clock, requests=1)
    clock.advance(0.5)
    seen(headroom, clock, request(rpm=10), requests=7)  # newer: 7 + 1 > 7.5, not roomy
    late = request(rpm=10)
    headroom.opening(late)
    headroom.answered(late, early)  # an answer that left Redis before the newer one
    assert not headroom.roomy(request(rpm=10))  # still judged by the newer (1 + 1 would pass)


def test_a_budget_reported_in_a_period_now_over_judges_nothing(clock):
    headroom = Headroom(clock)
    limits = {"budget_tokens": 1000, "budget_period": 3600.0}
    seen(headroom, clock, request(**limits), budget_used=10)
    assert headroom.roomy(request(**limits))
    clock.advance(3600 - START % 3600 - 1.0)  # a second before the period ends
    seen(headroom, clock, request(**limits), budget_used=10)
    clock.advance(1.0)  # the next period
    assert not headroom.roomy(request(**limits))


def test_tenants_are_judged_apart_and_the_stale_are_swept(clock):
    headroom = Headroom(clock)
    for n in range(64):
        seen(headroom, clock, request(tenant=f"t{n}", rpm=100), requests=1)
    clock.advance(FRESH + 1)
    seen(headroom, clock, request(tenant="busy", rpm=100), requests=99)  # the 65th: a sweep
    assert not headroom.roomy(request(tenant="busy", rpm=100))  # its own usage, not theirs
    seen(headroom, clock, request(tenant="new", rpm=100), requests=1)
    assert headroom.roomy(request(tenant="new", rpm=100))
    assert sorted(headroom._usage) == ["busy", "new"]  # the 64 stale ones are gone
