"""A run's deadlines (design §2): defaults from the settings, tenants may lower them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Deadlines:
    """Seconds; None means no limit. Each one that fires is its own terminal cause."""

    queue: float | None = None  # run start → the upstream admits it (or its first token)
    ttft: float | None = None  # run start → first token
    inter_token: float | None = None  # between tokens
    total: float | None = None  # run start → end


def next_deadline(
    deadlines: Deadlines,
    started: float,
    now: float,
    *,
    admitted: bool,
    first_token_at: float | None,
    last_token_at: float | None,
) -> tuple[str, float | None]:
    """The deadline that fires first from `now` (`total`, `queue`, `ttft`, `inter_token`) and
    the seconds left until it (0 when past), or ("none", None) when none applies any more."""
    d = deadlines
    candidates = []
    if d.total is not None:
        candidates.append(("total", started + d.total - now))
    if not admitted and d.queue is not None:
        candidates.append(("queue", started + d.queue - now))
    if first_token_at is None and d.ttft is not None:
        candidates.append(("ttft", started + d.ttft - now))
    if last_token_at is not None and d.inter_token is not None:
        candidates.append(("inter_token", last_token_at + d.inter_token - now))
    if not candidates:
        return "none", None
    kind, left = min(candidates, key=lambda c: c[1])
    return kind, max(0.0, left)


class Alarm:
    """One lazy timer: at most one call pending, armed again by whoever it calls.
    NOTE: a run keeps one of these instead of a timeout around every read: armed for the
    nearest deadline as last computed, it recomputes when it rings (tokens may have come since)
    and either acts or is armed again. It holds what it calls only while armed: a run that
    ended is freed by its reference count, not left to the cyclic collector (which the gateway
    runs seldom, gateway/gc_policy.py) with its whole completion."""

    __slots__ = ("_handle",)

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, delay: float | None, ring: Callable[[], None]) -> None:
        """Call `ring` in `delay` seconds (None: not at all), instead of any earlier arming."""
        self.cancel()
        if delay is not None:
            self._handle = asyncio.get_running_loop().call_later(delay, self._rang, ring)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _rang(self, ring: Callable[[], None]) -> None:
        self._handle = None
        ring()
