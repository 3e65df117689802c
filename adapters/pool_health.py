"""A pool's view of its members' health (design §6): the probe round, exits, restarts.

`ready()` is asked every second by the gateway's prober: it probes every member at once, each
within `probe_timeout`; a member that does not answer is out until it does, and its reported
step counter shows a hung engine (adapters/pool_members.py). A member that stalls, or misses
`EVICT_AFTER_PROBES` probes in a row, has its streams moved elsewhere; one that stalls, or
answers no probe at all for `stall_timeout`, is reported hung (`on_stall`: a local worker is
restarted); a stream of a member without stats that is silent mid-stream for `stall_timeout`
moves too. A local worker whose process exits is out at once (`member_exited`, told by its
supervisor), and `restarting` until a probe finds the new process serving.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog

from adapters.pool_members import EVICT_AFTER_PROBES, Member, Probe

log = structlog.get_logger("sluice.pool")


class PoolHealth:
    """The health half of PoolAdapter (adapters/pool.py), which owns the state it reads."""

    members: list[Member]
    clock: Callable[[], float]
    stall_timeout: float
    probe_timeout: float
    on_stall: Callable[[str], Any] | None
    crash_looping: Callable[[str], bool] | None
    _exited: set[str]
    _exits: Counter[str]
    _changed: asyncio.Event

    async def ready(self) -> bool:
        """Probe every member; whether any can take work."""
        exits = self._exits.copy()
        results = await asyncio.gather(*(self._probe(m) for m in self.members))
        now = self.clock()
        for member, probe in zip(self.members, results, strict=True):
            if self._exits[member.name] != exits[member.name]:
                continue  # NOTE: it exited while probed: the answer may be the dead process's
            if probe.ok:
                self._exited.discard(member.name)
            was = member.usable(now)
            if hung := member.probed(probe, now, self.stall_timeout):
                log.error("pool member hung", member=member.name, why=hung, steps=member.steps)
                if self.on_stall is not None:
                    self.on_stall(member.name)
            lost = member.stalled or member.silent_probes >= EVICT_AFTER_PROBES
            if lost and (moved := member.evict_all()):
                log.warning("pool member lost; moving its streams", member=member.name, n=moved)
            if member.usable(now) != was:
                (log.info if not was else log.warning)(
                    "pool member back" if not was else "pool member out", member=member.name
                )
                if not was:
                    self._changed.set()
        self._evict_silent(now)
        self._changed.set()  # NOTE: waiting runs look again (a cooldown ended, a suspect passed)
        return any(m.available(now) for m in self.members)

    def _evict_silent(self, now: float) -> None:
        """A member without stats (an OpenAI-compatible server) shows no stalled engine: a
        stream of it that sent nothing mid-stream for the stall timeout has failed, and moves."""
        for member in self.members:
            for lease in member.leases:
                if lease.heard is not None and now - lease.heard >= self.stall_timeout:
                    log.warning("pool member silent mid-stream; moving its run", member=member.name)
                    lease.evict()

    async def _probe(self, member: Member) -> Probe:
        stats_of = getattr(member.adapter, "stats", None)
        member.asked_with = len(member.leases)
        try:
            async with asyncio.timeout(self.probe_timeout):
                ok = await member.adapter.ready()
                stats = await stats_of() if ok and stats_of is not None else None
        except TimeoutError:
            return Probe(ok=False, answered=False)
        return Probe(ok, stats=stats)

    def member_exited(self, name: str) -> None:
        """The member's process is gone (its supervisor saw it exit): out of routing now, not at
        the next probe, until a probe finds it ready again (a restart still loading is not);
        `restarting` meanwhile, unless its supervisor says it crash loops."""
        for member in self.members:
            if member.name == name:
                member.healthy = False
                self._exited.add(name)
                self._exits[name] += 1

    def can_serve(self) -> bool:
        """Whether a member can take work now, as the last probes and exits left them (no
        probe: the gateway's readiness is recomputed with it the moment a member exits)."""
        now = self.clock()
        return any(m.available(now) for m in self.members)

    def restarting(self) -> list[str]:
        """The members out because their process exited, whose supervisor is bringing them back
        (not crash looping): a request that finds no usable member may wait for them."""
        looping = self.crash_looping
        return [
            m.name
            for m in self.members
            if m.name in self._exited and (looping is None or not looping(m.name))
        ]
