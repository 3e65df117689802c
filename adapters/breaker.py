"""A circuit breaker per pool member (design §6): a member that keeps failing requests is taken
out of routing for a cooldown, then let one request through before it gets traffic again.

Distinct from health probes (adapters/pool_members.py): a probe asks whether the member is up;
the breaker counts what its real requests did, so a member that answers its probes and fails its
requests (a 500 on every chat, every stream cut or stalled) goes out all the same, and a passing
probe does not bring it back before its cooldown is over.

- closed: requests flow. `consecutive` failures in a row, or failures making `rate` or more of
  the outcomes of the last `window` seconds (once there are `min_requests` of them), open it.
- open: out of routing for a cooldown, `cooldown` seconds the first time, doubling each time it
  opens again without having closed, up to `max_cooldown`; each stretched or shrunk at random by
  up to `jitter` of itself, so replicas that saw one outage do not all probe at the same moment.
- half-open: the cooldown is over; exactly one request, the probe, is let through. Its success
  closes the breaker; its failure opens it again with the next, longer cooldown. A probe that
  ends with no outcome (its client went away first, a 400) lets the next request probe.

What is a failure or a success is the pool's to say (adapters/pool.py). Outcomes of requests
sent before the breaker opened, or beside the probe, are not counted: only the probe's decides.
The clock is the caller's: every method takes `now`.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from enum import IntEnum

import structlog

log = structlog.get_logger("sluice.pool")


class BreakerState(IntEnum):
    """The values of `sluice_member_breaker_state`."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2

    @property
    def label(self) -> str:
        """As `/readyz` and the pool's snapshot say it."""
        return self.name.lower()


@dataclass(slots=True, frozen=True)
class BreakerPolicy:
    consecutive: int = 5  # failures in a row that open it
    rate: float = 0.5  # share of failures over the window that opens it …
    min_requests: int = 10  # … once the window holds this many outcomes
    window: float = 10.0  # seconds
    cooldown: float = 5.0  # seconds out the first time; doubles on each re-open
    max_cooldown: float = 60.0
    jitter: float = 0.2  # a cooldown is stretched or shrunk by up to this share of itself

    def __post_init__(self) -> None:
        if self.consecutive < 1 or self.min_requests < 1 or self.window <= 0:
            raise ValueError("a breaker needs a failure to open and a window to count in")
        if not 0 < self.rate <= 1 or not 0 <= self.jitter < 1:
            raise ValueError("a breaker's rate is in (0, 1], its jitter in [0, 1)")


class Breaker:
    """One member's breaker. `name`: the member's, for the log lines when it opens and closes."""

    __slots__ = (
        "_failures",
        "_opens",
        "_probing",
        "_recent",
        "_reopen_at",
        "_rng",
        "_state",
        "_streak",
        "name",
        "opened_total",
        "policy",
    )

    def __init__(
        self, name: str = "", policy: BreakerPolicy | None = None, rng: random.Random | None = None
    ) -> None:
        self.name = name
        self.policy = policy or BreakerPolicy()
        self.opened_total = 0
        self._rng = rng or random.Random()
        self._state = BreakerState.CLOSED
        self._reopen_at = 0.0  # open: when it turns half-open
        self._opens = 0  # opens since it last closed (the cooldown doubles with each)
        self._probing = False  # half-open: the probe is out
        self._recent: deque[tuple[float, bool]] = deque()  # closed: (when, failed) in the window
        self._failures = 0  # failures in `_recent`
        self._streak = 0  # failures in a row

    def state(self, now: float) -> BreakerState:
        """Open turns half-open by itself once its cooldown is over."""
        if self._state is BreakerState.OPEN and now >= self._reopen_at:
            return BreakerState.HALF_OPEN
        return self._state

    def allows(self, now: float) -> bool:
        """Whether a request may be routed to the member now (routing asks; nothing changes)."""
        state = self.state(now)
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probing
        )

    def admit(self, now: float) -> bool:
        """A request was routed to the member: True when it is the half-open probe, the one
        whose outcome decides."""
        if self.state(now) is not BreakerState.HALF_OPEN or self._probing:
            return False
        self._state = BreakerState.HALF_OPEN
        self._probing = True
        return True

    def release(self) -> None:
        """The probe ended with no outcome: the next request probes."""
        self._probing = False

    def succeeded(self, now: float, probe: bool) -> bool:
        """A request succeeded on the member; True when that closed the breaker."""
        if probe:
            self._probing = False
            if self._state is BreakerState.HALF_OPEN:
                self._close()
                return True
        elif self._state is BreakerState.CLOSED:
            self._streak = 0
            self._note(now, False)
        return False

    def failed(self, now: float, probe: bool) -> str | None:
        """A request failed on the member; why the breaker opened (`consecutive`, `rate`,
        `probe`), or None when it did not."""
        if probe:
            self._probing = False
            if self._state is not BreakerState.HALF_OPEN:
                return None
            why = "probe"
        elif self._state is BreakerState.CLOSED:
            self._streak += 1
            self._note(now, True)
            why = self._why_open()
        else:
            return None  # sent before it opened, or beside the probe: already out
        if why is not None:
            self._open(now, why)
        return why

    def _note(self, now: float, failed: bool) -> None:
        recent = self._recent
        recent.append((now, failed))
        self._failures += failed
        horizon = now - self.policy.window
        while recent[0][0] <= horizon:
            self._failures -= recent.popleft()[1]

    def _why_open(self) -> str | None:
        policy = self.policy
        if self._streak >= policy.consecutive:
            return "consecutive"
        n = len(self._recent)
        if n >= policy.min_requests and self._failures >= policy.rate * n:
            return "rate"
        return None

    def _open(self, now: float, why: str) -> None:
        policy = self.policy
        step = policy.cooldown * 2**self._opens
        jittered = step * (1 + policy.jitter * (2 * self._rng.random() - 1))
        cooldown = min(policy.max_cooldown, jittered)
        self._state = BreakerState.OPEN
        self._reopen_at = now + cooldown
        self._opens += 1
        self._probing = False
        self.opened_total += 1
        self._forget()
        log.warning("member breaker open", member=self.name, why=why, cooldown=round(cooldown, 3))

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._opens = 0
        self._forget()
        log.info("member breaker closed", member=self.name)

    def _forget(self) -> None:
        self._recent.clear()
        self._failures = 0
        self._streak = 0
