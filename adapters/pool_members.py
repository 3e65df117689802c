"""What a pool knows of each member: whether it can take work, how loaded it says it is, and
whether its engine is moving (design §6).

Load comes from the member's own reported stats (waiting + running), which every gateway replica
reads alike, so N replicas agree without talking to each other; requests routed since the last
report and still streaming are added so a burst between two reports does not all land on one
member (one that already ended is in no report, and loads nothing now). A member with
work whose step counter stands still for `stall_timeout` has a hung engine (its /health may
still say 200): it is ejected until its steps move again, and its owner (the supervisor, for a
local worker) is told so it can restart it. So is a member that answers no probe at all for
`stall_timeout` (SIGSTOPped, wedged): it sends no stats, so its steps cannot tell.

A request that fails on a member does not take it out by itself: its circuit breaker
(adapters/breaker.py) counts the outcomes of its requests (a failure: unreachable, a 5xx, a 429,
a broken, malformed or stalled stream, an error it reports in-band; a success: its first output),
and opens on failures in a row or a high error rate; open, it is out of routing until its
cooldown ends, then one request probes it. A member that answered 429 or 503 with `retry-after`
is skipped until then (at most `MAX_REST`), whatever its probes say.

Ejections are counted as events, a member going from in routing to out of it, by reason
(`EJECTION_REASONS`; `failure`: its breaker opened); a member already out is not ejected again.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from adapters.base import Adapter, BackendUnavailable
from adapters.breaker import Breaker, BreakerState
from adapters.events import Accepted, Admitted, ErrorEvent, Event
from adapters.worker_client import engine_slots

MAX_REST = 60.0  # seconds at most that a member's own retry-after keeps it out
# in-band errors that are the member's failure, not the request's (a worker's, an upstream's)
MEMBER_FAULTS = frozenset({"worker_error", "upstream_error"})
EVICT_AFTER_PROBES = 3  # a member silent for this many probes in a row has its streams moved
# why a member was taken out of routing: it failed or did not answer its probe; its engine
# stalled with work; its breaker opened on failed requests
EJECTION_REASONS = ("probe", "stall", "failure")


@dataclass(slots=True, frozen=True)
class Probe:
    """What one probe of a member found."""

    ok: bool  # it answered that it is ready
    answered: bool = True  # it answered at all within the probe timeout (refused counts)
    stats: dict[str, Any] | None = None  # its own load and step counter (our workers)


class MemberLost(Exception):
    """The member streaming a request was taken out (hung, stalled, silent): move the request."""


class Lease:
    """One request streaming from one member: the pool can interrupt its read to move it."""

    __slots__ = (
        "_interrupted",
        "_reading",
        "evicted",
        "faulted",
        "heard",
        "judged",
        "member",
        "probe",
        "report",
    )

    def __init__(self, member: Member, report: int, probe: bool = False) -> None:
        self.member = member
        self.report = report  # the member's reports before it: later ones count this request
        self.evicted = False
        self.probe = probe  # the request its half-open breaker let through
        self.judged = False  # an outcome (success or failure) was counted for its breaker
        self.faulted = False  # a failure was (one per request)
        # when a member without stats last sent this stream something, once it is mid-stream:
        # the pool's probe round moves a stream silent for the stall timeout (None: not watched)
        self.heard: float | None = None
        self._reading: asyncio.Task[Any] | None = None  # the task inside `read`, while it is
        self._interrupted = False  # `evict` cancelled that read

    def reading(self, task: asyncio.Task[Any] | None) -> int:
        """`task` is now waiting on the member (None: no longer); what `lost` compares with.
        MemberLost when the member was taken out already.

        NOTE: `evict` cancels the reading task, and only a cancel of its own becomes MemberLost
        (another cancel, counted past the ones before, goes on up): what `asyncio.timeout`
        does, without its object and handle on every batch of every stream. The pool reads in
        its own loop (adapters/pool.py `_stream_from`), with no coroutine of its own per batch."""
        if task is not None and self.evicted:
            raise MemberLost(self.member.name)
        self._reading = task
        return 0 if task is None else task.cancelling()

    def lost(self, task: asyncio.Task[Any], cancels_before: int) -> bool:
        """Whether the cancel that ended a read was `evict`'s (the read then raises MemberLost)."""
        return self._interrupted and task.uncancel() <= cancels_before

    def evict(self) -> None:
        """Interrupt the read now (it is waiting on a member that will not answer)."""
        self.evicted = True
        if self._reading is not None and not self._interrupted:
            self._interrupted = True
            self._reading.cancel()


@dataclass(slots=True)
class Member:
    adapter: Adapter
    name: str = ""  # in metrics and logs, unique in its pool (the adapter's name by default)
    healthy: bool = True  # its last probe passed (none yet: taken to be up)
    rest_until: float = 0.0  # it answered 429/503 with retry-after: not routed to until then
    suspect: bool = False  # a request failed on it since its last passing probe or success
    stalled: bool = False  # had work and did not step for the stall timeout
    load: int = 0  # waiting + running, as it last reported
    reported: bool = False  # it reports stats (our workers); else `in_flight` is its load
    routed: int = 0  # requests routed to it since that report, still streaming
    reports: int = 0  # stats reports received
    steps: int | None = None
    steps_moved_at: float = 0.0  # when its step counter last moved (or it had no work)
    silent_probes: int = 0  # probes in a row it did not pass
    unanswered_since: float | None = None  # first of the probes in a row it did not answer at all
    hung: bool = False  # unanswered for the stall timeout (reported once, until it answers)
    leases: set[Lease] = field(default_factory=set)  # this gateway's requests streaming from it
    prefix_hit_ratio: float | None = None  # its prefix cache's hits / lookups, as it reports
    kv_usage: float = 0.0  # the share of its KV blocks in use, as it reports
    slots: int | None = None  # engine_slots of its max_num_seqs, as it reports
    others: int = 0  # of its reported load, what is not this gateway's (other replicas')
    asked_with: int = 0  # this gateway's streams on it when its latest stats were asked for
    # counted for the metrics
    requests_total: int = 0
    failures_total: int = 0
    ejections: Counter[str] = field(default_factory=Counter)  # reason → times taken out
    stalls_total: int = 0
    breaker: Breaker = field(default_factory=Breaker)  # what its requests did (design §6)

    def __post_init__(self) -> None:
        self.name = self.name or self.adapter.name
        self.breaker.name = self.name

    def usable(self, now: float) -> bool:
        """Whether a request may be routed to it now."""
        return (
            self.healthy
            and not self.stalled
            and now >= self.rest_until
            and self.breaker.allows(now)
        )

    def available(self, now: float) -> bool:
        """Whether it counts as serving, for readiness: up, and its breaker not open (half-open
        with its probe out still serves; so does one resting on a retry-after)."""
        return self.healthy and not self.stalled and self.breaker.state(now) < BreakerState.OPEN

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    def capacity(self) -> int | None:
        """Runs this gateway may stream from it at once (flow control, design §12): its slots
        less what other replicas run there, as it last reported; else the adapter's own
        bound (an upstream's configured capacity); None: unbounded."""
        if self.slots is not None:
            return max(0, self.slots - self.others)
        own = getattr(self.adapter, "capacity", None)
        return None if own is None else own()

    def score(self) -> int:
        return self.load + self.routed if self.reported else self.in_flight

    def lease(self, now: float) -> Lease:
        """A request (or a run's continuation) streams from this member from now on."""
        self.routed += 1
        self.requests_total += 1
        lease = Lease(self, self.reports, self.breaker.admit(now))
        self.leases.add(lease)
        return lease

    def release(self, lease: Lease) -> None:
        """Its stream ended: no longer load, unless a report since counts it already; a probe
        that ended with no outcome (a refusal, its client gone) lets the next request probe."""
        self.leases.discard(lease)
        if lease.report == self.reports:
            self.routed -= 1
        if lease.probe and not lease.judged:
            self.breaker.release()

    def evict_all(self) -> int:
        """Move every request streaming from this member elsewhere; how many there were."""
        for lease in self.leases:
            lease.evict()
        return len(self.leases)

    def served(self, lease: Lease, batch: list[Event], now: float) -> None:
        """What a batch of the request says of the member: its first output (past `start` and
        `admitted`) is a success; an error it reports in-band (MEMBER_FAULTS) a failure."""
        for event in batch:
            kind = type(event)
            if kind is ErrorEvent and event.code in MEMBER_FAULTS:
                self.failed(now, lease)
                return
            if kind is not Accepted and kind is not Admitted:
                self.answered(lease, now)

    def answered(self, lease: Lease, now: float) -> None:
        """The request's first output came (or its whole answer, an embedding's): a success."""
        if not lease.judged:
            lease.judged = True
            self.suspect = False
            self.breaker.succeeded(now, lease.probe)

    def failed(self, now: float, lease: Lease | None = None, exc: Exception | None = None) -> None:
        """A request failed here (once per request): counted, and by its breaker, which may
        take the member out; a retry-after it answered with keeps it out until then."""
        if lease is not None:
            if lease.faulted:
                return
            probe = lease.probe and not lease.judged
            lease.faulted = lease.judged = True
        else:
            probe = False
        self.failures_total += 1
        self.suspect = True
        if isinstance(exc, BackendUnavailable) and exc.upstream_retry_after is not None:
            self.rest_until = max(self.rest_until, now + min(exc.upstream_retry_after, MAX_REST))
        if self.breaker.failed(now, probe) and self.healthy and not self.stalled:
            self.ejections["failure"] += 1

    def probed(self, probe: Probe, now: float, stall_timeout: float) -> str | None:
        """A probe's result. `stall` or `silent` when this probe found the member newly hung
        (its engine stalled with work, or it answered nothing for `stall_timeout`), so its
        owner should restart it; else None."""
        was = self.usable(now)
        hung = self._heard(probe, now, stall_timeout)
        if probe.stats is not None and self._reported(probe.stats, now, stall_timeout):
            hung = "stall"
        if was and not self.usable(now):
            self.ejections["stall" if self.stalled else "probe"] += 1
        return hung

    def _heard(self, probe: Probe, now: float, stall_timeout: float) -> str | None:
        """Health and silence from the probe; `silent` when it newly went unanswered too long."""
        self.healthy = probe.ok
        self.silent_probes = 0 if probe.ok else self.silent_probes + 1
        self.suspect = self.suspect and not probe.ok
        if probe.answered:
            self.unanswered_since, self.hung = None, False
            return None
        if self.unanswered_since is None:
            self.unanswered_since = now
        if self.hung or now - self.unanswered_since < stall_timeout:
            return None
        self.hung = True
        return "silent"

    def _reported(self, stats: dict[str, Any], now: float, stall_timeout: float) -> bool:
        """Load and steps from the member's own stats; True when its engine newly stalled."""
        self.reported, self.routed = True, 0
        self.reports += 1
        work = int(stats.get("waiting", 0)) + int(stats.get("running", 0))
        self.load = work
        # NOTE: a stream of ours that ended while the report was on its way is in the report;
        # counting it as another replica's would shrink the capacity until the next report
        self.others = max(0, work - max(len(self.leases), self.asked_with))
        max_num_seqs = stats.get("max_num_seqs")
        if isinstance(max_num_seqs, int) and max_num_seqs > 0:
            self.slots = engine_slots(max_num_seqs)
        total = stats.get("kv_blocks_total") or 0
        self.kv_usage = (stats.get("kv_blocks_used") or 0) / total if total else 0.0
        queries = stats.get("prefix_cache_queries") or 0
        if queries:
            self.prefix_hit_ratio = (stats.get("prefix_cache_hits") or 0) / queries
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
            return True
        return False

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "member": self.name,
            "healthy": self.healthy and not self.stalled,
            "breaker": self.breaker.state(now).label,
            "in_flight": self.in_flight,
            "load": self.score(),
            "requests": self.requests_total,
            "failures": self.failures_total,
            "ejections": {reason: self.ejections[reason] for reason in EJECTION_REASONS},
            "stalls": self.stalls_total,
            "prefix_hit_ratio": self.prefix_hit_ratio,
        }
