"""The deadline half of the run driver (gateway/runs/driver.py), which owns the state it reads:
one lazy alarm for the run's deadlines while it waits or streams (design §2), then for the
upstream's confirmation of an early stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.runs.deadlines import Alarm, next_deadline
from gateway.runs.status import Phase, RunStatus

if TYPE_CHECKING:
    from gateway.runs.accounting import RunAccounting
    from gateway.runs.spec import RunSpec


class DeadlineWatch:
    """Arms, rings and re-arms the driver's alarm; a deadline past stops the run."""

    spec: RunSpec
    acct: RunAccounting
    phase: Phase
    status: RunStatus
    _timer: Alarm
    stop: Callable[..., bool]  # RunDriver.stop: decide the run's early ending
    _close_upstream: Callable[[], None]  # close the stream an unconfirmed stop left open

    # NOTE: per batch the driver only notes the token time (the Alarm recomputes when it rings).
    # Once the run is stopping, the same alarm bounds the wait for the upstream's confirmation.
    def _arm(self, delay: float | None = None) -> None:
        self._timer.arm(self._next_deadline()[1] if delay is None else delay, self._on_timer)

    def _on_timer(self) -> None:
        if self.phase is Phase.STOPPING:  # the upstream did not confirm the stop in time
            self._close_upstream()
            return
        if self.phase is not Phase.STREAMING and self.phase is not Phase.WAITING:
            return
        kind, left = self._next_deadline()
        if left is not None and left <= 0:
            self.stop(RunStatus.TIMED_OUT, f"deadline:{kind}", "timeout")
        else:
            self._arm(left)

    def _next_deadline(self) -> tuple[str, float | None]:
        return next_deadline(
            self.spec.deadlines,
            self.acct.started,
            time.monotonic(),
            admitted=self.status >= RunStatus.ADMITTED,
            first_token_at=self.acct.first_arrival_at,
            last_token_at=self.acct.last_arrival_at,
        )
