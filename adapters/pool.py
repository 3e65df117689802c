"""Several adapters serving one model (design §6): each request goes to the member that serves
it best, a failing member costs the client nothing it can see, and a hung one is ejected.

- Routing: among the usable members (healthy, not ejected, not stalled), the one holding the
  longest prefix of the prompt (adapters/prefix_affinity.py), unless it is overloaded (more than
  `AFFINITY_SLACK` requests above the least loaded), in which case load wins; load is the
  members' own reported waiting + running (adapters/pool_members.py).
- Health: `ready()` (asked every second by the gateway's prober) probes every member at once,
  each within `probe_timeout`: a member that does not answer is out until it does; its reported
  step counter shows a hung engine.
- Retry: a request whose member fails before the first event (unreachable, 503, a broken
  connection) goes to the next member; a refusal (a 400) is the request's own fault and is not
  retried. After the first event a failure is the run's (continuing it elsewhere is not done).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import structlog

from adapters.base import Adapter, BackendFailed, BackendUnavailable, ModelInfo
from adapters.events import Event
from adapters.pool_members import Member
from adapters.prefix_affinity import PrefixAffinity, prefix_keys
from adapters.requests import ChatRequest

log = structlog.get_logger("sluice.pool")
AFFINITY_SLACK = 2
RETRIED = (BackendUnavailable, BackendFailed)


class PoolAdapter:
    def __init__(
        self,
        members: list[Adapter],
        name: str = "pool",
        *,
        stall_timeout: float = 10.0,
        probe_timeout: float = 0.8,
        on_stall: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_stall(member_name)`: a member's engine is hung (a local one can be restarted)."""
        if not members:
            raise ValueError("a pool needs at least one member")
        self.name = name
        self.members = [Member(a) for a in members]
        self.stall_timeout = stall_timeout
        self.probe_timeout = probe_timeout
        self.on_stall = on_stall
        self.clock = clock
        self.affinity = PrefixAffinity()
        self.affinity_routes = 0
        self._turn = 0
        self._serving: dict[str, Member] = {}  # live request id → the member streaming it

    async def start(self) -> None:
        for member in self.members:
            await member.adapter.start()
        await self.ready()

    async def close(self) -> None:
        for member in self.members:
            await member.adapter.close()

    async def models(self) -> list[ModelInfo]:
        return await self.members[0].adapter.models()

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return self.members[0].adapter.unsupported_param(request)

    # -- health ----------------------------------------------------------------------------------

    async def ready(self) -> bool:
        """Probe every member; whether any can take work."""
        results = await asyncio.gather(*(self._probe(m) for m in self.members))
        now = self.clock()
        for member, (ok, stats) in zip(self.members, results, strict=True):
            was = member.usable(now)
            if member.probed(ok, stats, now, self.stall_timeout):
                log.error("pool member stalled", member=member.name, steps=member.steps)
                if self.on_stall is not None:
                    self.on_stall(member.name)
            if member.usable(now) != was:
                (log.info if not was else log.warning)(
                    "pool member back" if not was else "pool member out", member=member.name
                )
        return any(m.usable(now) for m in self.members)

    async def _probe(self, member: Member) -> tuple[bool, dict[str, Any] | None]:
        stats_of = getattr(member.adapter, "stats", None)
        try:
            async with asyncio.timeout(self.probe_timeout):
                ok = await member.adapter.ready()
                stats = await stats_of() if ok and stats_of is not None else None
        except TimeoutError:
            return False, None
        return ok, stats

    def snapshot(self) -> list[dict[str, Any]]:
        return [m.snapshot() for m in self.members]

    # -- routing ---------------------------------------------------------------------------------

    def choose(self, request: ChatRequest, tried: set[int]) -> int | None:
        """The index of the member to send `request` to, or None when none is left."""
        now = self.clock()
        usable = [i for i, m in enumerate(self.members) if i not in tried and m.usable(now)]
        if not usable:
            return None
        n, turn = len(self.members), self._turn
        least = min(usable, key=lambda i: (self.members[i].score(), (i - turn) % n))
        self._turn = (turn + 1) % n  # equal loads take turns
        floor = self.members[least].score()
        keys = prefix_keys(request)
        chosen = least
        for owner in self.affinity.owners(keys):
            if owner in usable and self.members[owner].score() <= floor + AFFINITY_SLACK:
                chosen = owner
                self.affinity_routes += owner != least
                break
        self.affinity.remember(keys, chosen)
        return chosen

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        tried: set[int] = set()
        last: Exception = BackendUnavailable("No member of the pool can serve this model now.")
        while (index := self.choose(request, tried)) is not None:
            tried.add(index)
            member = self.members[index]
            member.routed += 1
            member.routed_total += 1
            member.in_flight += 1
            self._serving[request_id] = member
            started = False
            try:
                async with aclosing(member.adapter.stream(request, request_id)) as events:
                    async for batch in events:
                        started = True
                        yield batch
                return
            except RETRIED as exc:
                if started:
                    raise
                member.failed(self.clock())
                log.warning("pool member failed a request", member=member.name, retry=True)
                last = exc
            finally:
                member.in_flight -= 1
                if self._serving.get(request_id) is member:
                    del self._serving[request_id]
        raise last

    async def abort(self, request_id: str) -> bool:
        """Routed to the member streaming `request_id`; an id no member streams is False."""
        member = self._serving.get(request_id)
        return False if member is None else await member.adapter.abort(request_id)
