"""The run state machine (DESIGN §2): one terminal state, reached exactly once.

Statuses are ordered so "terminal" is one comparison; one table maps each status to the `status`
field of the stored object, one to the terminal cause's error code on the wire.
"""

from __future__ import annotations

import enum


class RunStatus(enum.IntEnum):
    RECEIVED = 0
    QUEUED = 1
    ADMITTED = 2
    PREFILL = 3
    DECODING = 4
    FINALIZING = 5
    # terminal from here on
    COMPLETED = 6
    CANCELLED = 7
    TIMED_OUT = 8
    FAILED = 9
    REJECTED = 10

    @property
    def is_terminal(self) -> bool:
        return self >= RunStatus.COMPLETED


PUBLIC_STATUS: dict[RunStatus, str] = {
    RunStatus.RECEIVED: "queued",
    RunStatus.QUEUED: "queued",
    RunStatus.ADMITTED: "in_progress",
    RunStatus.PREFILL: "in_progress",
    RunStatus.DECODING: "in_progress",
    RunStatus.FINALIZING: "in_progress",
    RunStatus.COMPLETED: "completed",
    RunStatus.CANCELLED: "cancelled",
    RunStatus.TIMED_OUT: "timed_out",
    RunStatus.FAILED: "failed",
    RunStatus.REJECTED: "failed",
}

# The error `code` a stream ends with when the run did not complete.
TERMINAL_ERROR_CODE: dict[RunStatus, str] = {
    RunStatus.CANCELLED: "cancelled",
    RunStatus.TIMED_OUT: "timeout",
    RunStatus.FAILED: "upstream_error",
    RunStatus.REJECTED: "rejected",
}


def can_advance(current: RunStatus, new: RunStatus) -> bool:
    """Forward moves only, and nothing after a terminal state."""
    return not current.is_terminal and new > current
