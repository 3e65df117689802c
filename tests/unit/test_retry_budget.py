"""The gateway's retry budget (adapters/retry_budget.py) on a fake clock: retries are a share of
the requests of a sliding window, with a minimum, spaced by a jittered backoff."""

from __future__ import annotations

import pytest

from adapters.base import BackendFailed, BackendUnavailable, parse_retry_after
from adapters.pool_members import MemberLost
from adapters.retry_budget import REFUSED, RetryBudget, retry_reason


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fixed:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def budget(ratio: float = 0.2, **options) -> tuple[RetryBudget, Clock]:
    clock = Clock()
    return RetryBudget(ratio, clock=clock, **options), clock


def allowed(b: RetryBudget, tries: int, reason: str = "failed") -> int:
    return sum(b.allow(reason) for _ in range(tries))


def test_retries_are_at_most_the_share_of_the_windows_requests():
    b, _ = budget(0.2, min_retries=0)
    for _ in range(100):
        b.requested()
    assert allowed(b, 30, "unavailable") == 20
    assert b.counts == {"unavailable": 20, REFUSED: 10}


def test_a_gateway_with_little_traffic_may_still_retry_its_minimum():
    b, _ = budget(0.2, min_retries=10)
    for _ in range(3):
        b.requested()
    assert allowed(b, 12) == 10  # 0.2 * 3 would allow none
    for _ in range(97):
        b.requested()
    assert allowed(b, 20) == 10  # with 100 requests the share (20) is the bound again


def test_the_window_slides_old_requests_and_retries_leave_it():
    b, clock = budget(0.5, min_retries=0, window=10.0)
    for _ in range(10):
        b.requested()
    assert allowed(b, 6) == 5
    clock.now += 5.0
    for _ in range(10):
        b.requested()
    assert allowed(b, 6) == 5  # 20 requests, 5 retries: 5 more
    clock.now += 5.0  # the first 10 requests and their 5 retries are out of the window
    assert allowed(b, 1) == 0  # 10 requests, 5 retries: full
    for _ in range(2):
        b.requested()
    assert allowed(b, 2) == 1
    clock.now += 10.0
    assert allowed(b, 1) == 0  # nothing in the window: no share


def test_a_ratio_of_zero_turns_retries_off():
    b, _ = budget(0.0)
    for _ in range(100):
        b.requested()
    assert allowed(b, 1) == 0
    assert b.counts[REFUSED] == 1


def test_a_request_reaching_several_pools_counts_once_by_its_key():
    b, clock = budget(0.5, min_retries=0)
    for _ in range(3):
        b.requested("req_1")  # its alias's targets, one after another
    b.requested("req_2")
    assert allowed(b, 2) == 1  # 2 requests, not 4
    clock.now += 11.0
    b.requested("req_1")  # long gone from the window: a new request
    assert allowed(b, 1) == 0  # 1 request: half a retry


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [(1, 0.0125, 0.025), (2, 0.025, 0.05), (3, 0.05, 0.1), (7, 0.5, 1.0), (12, 0.5, 1.0)],
)
def test_backoff_is_jittered_between_half_and_all_of_a_doubling_capped_step(attempt, low, high):
    shortest, _ = budget(rng=Fixed(0.0))
    longest, _ = budget(rng=Fixed(0.999999))
    assert shortest.backoff(attempt) == pytest.approx(low)
    assert longest.backoff(attempt) == pytest.approx(high, rel=1e-5)
    drawn, _ = budget()
    assert all(low <= drawn.backoff(attempt) <= high for _ in range(200))


def test_the_reason_a_retry_is_counted_under():
    assert retry_reason(BackendUnavailable("x", status=429, upstream_retry_after=2.0)) == (
        "rate_limited"
    )
    assert retry_reason(BackendUnavailable("x", status=503)) == "unavailable"
    assert retry_reason(BackendUnavailable("unreachable")) == "unavailable"
    assert retry_reason(BackendFailed("HTTP 500")) == "failed"
    assert retry_reason(MemberLost("m")) == "failed"


def test_retry_after_is_read_as_seconds_or_an_http_date_and_nothing_else():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412500.0) == 0.0  # past
    assert parse_retry_after("-4") == 0.0
    assert [parse_retry_after(v) for v in (None, "", "soon", "nan", "inf")] == [None] * 5


def test_a_budget_that_makes_no_sense_is_refused():
    with pytest.raises(ValueError):
        RetryBudget(-0.1)
    with pytest.raises(ValueError):
        RetryBudget(0.2, window=0.0)
