"""A pool member's circuit breaker (adapters/breaker.py) on a fake clock: what opens it, the
cooldown that doubles with jitter, and the half-open state that lets exactly one request probe."""

from __future__ import annotations

import pytest

from adapters.breaker import Breaker, BreakerPolicy, BreakerState

CLOSED, HALF_OPEN, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


class Fixed:
    """A random source that always draws `value` (0: the shortest jitter, ~1: the longest)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def breaker(jitter_draw: float = 0.5, **policy) -> Breaker:
    """A breaker with the default policy but for `policy`; a draw of 0.5 is no jitter."""
    return Breaker("m", BreakerPolicy(**policy), rng=Fixed(jitter_draw))


def fail(b: Breaker, now: float, times: int = 1) -> list[str | None]:
    return [b.failed(now, probe=False) for _ in range(times)]


def trip(b: Breaker, now: float) -> None:
    fail(b, now, b.policy.consecutive)
    assert b.state(now) is OPEN


def test_five_failures_in_a_row_open_it_and_a_success_between_resets_the_count():
    b = breaker()
    assert fail(b, 0.0, 4) == [None] * 4
    b.succeeded(0.5, probe=False)
    assert fail(b, 1.0, 4) == [None] * 4
    assert (b.state(1.0), b.allows(1.0)) == (CLOSED, True)
    assert b.failed(1.0, probe=False) == "consecutive"
    assert (b.state(1.0), b.allows(1.0), b.opened_total) == (OPEN, False, 1)


def test_half_of_ten_or_more_outcomes_in_the_window_open_it_by_error_rate():
    b = breaker()
    for i in range(4):  # failure, success, … never two failures in a row
        assert b.failed(i, probe=False) is None
        b.succeeded(i + 0.5, probe=False)
    assert b.failed(4.0, probe=False) is None  # 5 of 9: too few outcomes yet
    b.succeeded(4.5, probe=False)  # 5 of 10, but a success does not open it
    assert b.state(4.5) is CLOSED
    assert b.failed(5.0, probe=False) == "rate"  # 6 of 11


def test_the_window_slides_outcomes_older_than_it_are_forgotten():
    b = breaker()
    for i in range(4):
        b.failed(float(i), probe=False)
        b.succeeded(i + 0.5, probe=False)
    # ten seconds on, the early outcomes are gone: 4 fresh failures among 8 do not open it
    for i in range(4):
        b.succeeded(20.0 + i, probe=False)
        assert b.failed(20.5 + i, probe=False) is None
    assert b.state(24.0) is CLOSED
    b.succeeded(24.0, probe=False)
    assert b.failed(24.5, probe=False) == "rate"  # now 5 of 10, all within the window


def test_open_it_is_out_for_its_cooldown_then_half_open_lets_exactly_one_request_probe():
    b = breaker()
    trip(b, 100.0)
    assert not b.allows(104.99)
    assert not b.admit(104.99)  # nothing routed there: no probe either
    assert (b.state(105.0), b.allows(105.0)) == (HALF_OPEN, True)
    assert b.admit(105.0) is True  # this request is the probe
    assert (b.allows(105.0), b.admit(105.0)) == (False, False)  # and the only one
    assert b.state(105.0) is HALF_OPEN


def test_the_probes_success_closes_it():
    b = breaker()
    trip(b, 0.0)
    assert b.admit(5.0)
    assert b.succeeded(5.2, probe=True) is True
    assert (b.state(5.2), b.allows(5.2)) == (CLOSED, True)
    assert fail(b, 6.0, 4) == [None] * 4  # counting afresh
    assert b.failed(6.0, probe=False) == "consecutive"
    assert b.state(6.0 + 4.99) is OPEN  # after a close, the first cooldown again


def test_the_probes_failure_reopens_it_with_a_cooldown_doubling_up_to_the_cap():
    b = breaker(max_cooldown=30.0)
    trip(b, 0.0)
    now, cooldowns = 0.0, []
    for _ in range(5):
        opened = now
        while b.state(now) is OPEN:
            now += 0.25
        cooldowns.append(now - opened)
        assert b.admit(now)
        assert b.failed(now, probe=True) == "probe"
    assert cooldowns == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert b.opened_total == 6


@pytest.mark.parametrize(("draw", "first", "second"), [(0.0, 4.0, 8.0), (0.999999, 6.0, 12.0)])
def test_cooldowns_are_jittered_within_a_fifth_either_way(draw, first, second):
    b = breaker(jitter_draw=draw)
    trip(b, 0.0)
    assert b.state(first - 0.01) is OPEN and b.state(first + 0.01) is HALF_OPEN
    assert b.admit(first + 0.01)
    b.failed(first + 0.01, probe=True)
    reopened = first + 0.01
    assert b.state(reopened + second - 0.01) is OPEN
    assert b.state(reopened + second + 0.01) is HALF_OPEN


def test_outcomes_of_requests_sent_before_it_opened_or_beside_the_probe_do_not_count():
    b = breaker()
    trip(b, 0.0)
    assert b.failed(1.0, probe=False) is None  # a stream that began before it opened
    assert not b.succeeded(1.0, probe=False)
    assert b.state(5.0) is HALF_OPEN  # its cooldown was not stretched, nor cut short
    assert b.admit(5.0)
    assert b.failed(5.1, probe=False) is None  # not the probe's: it still decides
    assert b.succeeded(5.2, probe=True) is True


def test_a_probe_that_ends_without_an_outcome_lets_the_next_request_probe():
    b = breaker()
    trip(b, 0.0)
    assert b.admit(5.0)
    b.release()  # its client went away, or it was the request's own 400
    assert b.allows(5.0)
    assert b.admit(5.0)


def test_a_policy_that_could_never_open_or_count_is_refused():
    with pytest.raises(ValueError):
        BreakerPolicy(consecutive=0)
    with pytest.raises(ValueError):
        BreakerPolicy(rate=0.0)
    with pytest.raises(ValueError):
        BreakerPolicy(window=0.0)
