"""What a pool knows of each member: whether it can take work, how loaded it says it is, and
whether its engine is moving (design §6).

Load comes from the member's own reported stats (waiting + running), which every gateway replica
reads alike, so N replicas agree without talking to each other; requests routed since the last
report are added so a burst between two reports does not all land on one member. A member with
work whose step counter stands still for `stall_timeout` has a hung engine (its /health may
still say 200): it is ejected until its steps move again, and its owner (the supervisor, for a
local worker) is told so it can restart it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.base import Adapter

EJECT_FOR = 5.0  # seconds a member that failed a request sits out (a passing probe ends it early)


@dataclass(slots=True)
class Member:
    adapter: Adapter
    healthy: bool = True  # its last probe passed (none yet: taken to be up)
    ejected_until: float = 0.0  # failed a request: not routed to until then
    stalled: bool = False  # had work and did not step for the stall timeout
    load: int = 0  # waiting + running, as it last reported
    reported: bool = False  # it reports stats (our workers); else `in_flight` is its load
    routed: int = 0  # requests routed to it since that report
    in_flight: int = 0  # this gateway's requests streaming from it now
    steps: int | None = None
    steps_moved_at: float = 0.0  # when its step counter last moved (or it had no work)
    # counted for the metrics
    routed_total: int = 0
    failures_total: int = 0
    ejections_total: int = 0
    stalls_total: int = 0

    @property
    def name(self) -> str:
        return self.adapter.name

    def usable(self, now: float) -> bool:
        return self.healthy and not self.stalled and now >= self.ejected_until

    def score(self) -> int:
        return self.load + self.routed if self.reported else self.in_flight

    def failed(self, now: float) -> None:
        """A request failed here before its first event: sit out, so the next goes elsewhere."""
        self.failures_total += 1
        self.ejections_total += 1
        self.ejected_until = now + EJECT_FOR

    def probed(self, ok: bool, stats: dict[str, Any] | None, now: float, stall_timeout: float):
        """A probe's result; True when this probe found the engine newly stalled."""
        self.healthy = ok
        if ok and now < self.ejected_until:
            self.ejected_until = 0.0  # it answers again: back in
        if stats is None:
            return False
        self.reported, self.routed = True, 0
        work = int(stats.get("waiting", 0)) + int(stats.get("running", 0))
        self.load = work
        steps = stats.get("steps")
        if steps is None:
            return False
        if steps != self.steps or work == 0:
            self.steps, self.steps_moved_at = steps, now
            self.stalled = False
            return False
        if not self.stalled and now - self.steps_moved_at >= stall_timeout:
            self.stalled = True
            self.stalls_total += 1
            self.ejections_total += 1
            return True
        return False

    def snapshot(self) -> dict[str, Any]:
        return {
            "member": self.name,
            "healthy": self.healthy and not self.stalled,
            "in_flight": self.in_flight,
            "load": self.score(),
            "routed": self.routed_total,
            "failures": self.failures_total,
            "ejections": self.ejections_total,
            "stalls": self.stalls_total,
        }
