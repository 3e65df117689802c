"""The run state machine (design §2): one terminal state, reached exactly once.

Statuses are ordered so "terminal" is one comparison; one table maps each status to the `status`
field of the stored object, one to the terminal cause's error code on the wire. Every status is
entered by the run driver:

- `RECEIVED`: the run exists; nothing has been asked of the upstream yet.
- `QUEUED`: the upstream has been asked and has not begun computing it (it may have accepted it
  into its own queue: that is when the stream's role chunks go out).
- `ADMITTED`: the upstream began computing it (its prefill); the queue deadline ends here.
- `DECODING`: the first token came; the stream is flowing.
- `FINALIZING`: the upstream is done; the gateway writes the ending (usage chunk, the object).
- then one of the terminal statuses.
"""

from __future__ import annotations

import enum


class RunStatus(enum.IntEnum):
    RECEIVED = 0
    QUEUED = 1
    ADMITTED = 2
    DECODING = 3
    FINALIZING = 4
    # terminal from here on
    COMPLETED = 5
    CANCELLED = 6
    TIMED_OUT = 7
    FAILED = 8
    REJECTED = 9

    @property
    def is_terminal(self) -> bool:
        return self >= RunStatus.COMPLETED


PUBLIC_STATUS: dict[RunStatus, str] = {
    RunStatus.RECEIVED: "queued",
    RunStatus.QUEUED: "queued",
    RunStatus.ADMITTED: "in_progress",
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


class Phase(enum.IntEnum):
    """Where a run's driver is (gateway/runs/driver.py), apart from the status the store
    records: only the driver that runs the run knows it."""

    NEW = 0  # nothing asked of the upstream yet
    WAITING = 1  # queued in the gateway for the backend's capacity (flow control, design §12)
    STREAMING = 2  # reading the upstream's stream; nothing decided
    STOPPING = 3  # the ending is decided early; reading on for the upstream's confirmation
    ENDED = 4  # the upstream's stream is over
