"""The early-ending half of the run driver (gateway/runs/driver.py), which owns the state it
reads and writes.

There is one way to end early, `stop`: the ending is written at once (the terminal state and
the error frame, so every client hears at once), the upstream is asked to stop at its next step,
and the driver reads on until the upstream confirms: what arrives meanwhile is the tail, counted
and never sent. An upstream that cannot abort in-band, or does not confirm within
`confirm_timeout`, has its stream closed, which aborts the work there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.eager_tasks import start_eagerly
from gateway.runs.accounting import Ending
from gateway.runs.endings import STORE_LOST_CAUSE
from gateway.runs.status import Phase, RunStatus

if TYPE_CHECKING:
    from gateway.runs.deadlines import Alarm
    from gateway.runs.spec import RunSpec

CLOSE = "close the upstream stream"  # the driver's own cancel of its task, to close the stream


class Stopping:
    """Decides the run's early ending, writes it and stops the upstream."""

    spec: RunSpec
    run_id: str
    phase: Phase
    ending: Ending | None
    confirm_timeout: float
    _timer: Alarm
    _task: asyncio.Task[Any] | None
    _stopping: asyncio.Task[None] | None
    _arm: Callable[..., None]  # DeadlineWatch._arm: the alarm, here for the confirmation
    _write_ending: Callable[[], Awaitable[None]]  # RunDriver._write_ending

    def cancel(self, source: str) -> bool:
        """Stop the run (idempotent); `source` is `client`, `disconnect`, `shutdown`, … False when
        its fate was already decided."""
        return self.stop(RunStatus.CANCELLED, f"cancel:{source}", source)

    def lose_store(self) -> bool:
        """The shared store stayed away past its grace: end the run (failed,
        `store_unavailable`) and stop the upstream; False when its fate was already decided."""
        return self.stop(RunStatus.FAILED, STORE_LOST_CAUSE, "store")

    def stop(
        self, status: RunStatus, cause: str, source: str | None = None, error: dict | None = None
    ) -> bool:
        """Decide the run's early ending. With a `source` the upstream is told to stop (a cancel,
        a deadline); without one it is ending by itself (it reported a failure)."""
        if self.ending is not None:
            return False
        self.ending = Ending(status, cause, source, time.monotonic(), error)
        self._timer.cancel()
        if self.phase is Phase.WAITING and self.spec.ticket is not None:
            self.spec.ticket.withdraw()  # its wait ends now: nothing was asked upstream
        if self.phase is Phase.STREAMING:
            self.phase = Phase.STOPPING
            if source is not None:
                self._arm(self.confirm_timeout)  # unconfirmed by then: close the stream
            # NOTE: started eagerly: the abort leaves and the ending is written in this step,
            # not a turn of a busy loop later (a cancel's latency is counted from here)
            self._stopping = start_eagerly(self._stop_upstream(), name=f"stop {self.run_id}")
        return True

    async def _stop_upstream(self) -> None:
        """End the run for its clients now, and have the upstream stop."""
        source = self.ending.source if self.ending else None
        abort = start_eagerly(self.spec.adapter.abort(self.run_id)) if source else None
        await self._write_ending()
        if abort is None:
            return
        try:
            in_band = await abort
        except Exception:  # any failure here means: close the stream instead
            in_band = False
        if not in_band:
            self._close_upstream()

    def _close_upstream(self) -> None:
        if self.phase is Phase.STOPPING and self._task is not None and not self._task.done():
            self._task.cancel(CLOSE)
