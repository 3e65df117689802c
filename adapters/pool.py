"""Several adapters serving one model (design §6): each request goes to the member that serves
it best, and a dead or hung member costs the client nothing it can see.

- Routing: adapters/pool_routing.py (prefix affinity bounded by load, by default).
- Health: `ready()` (asked every second by the gateway's prober) probes every member at once,
  each within `probe_timeout`: a member that does not answer is out until it does; its reported
  step counter shows a hung engine (adapters/pool_members.py). A member that stalls, or misses
  `EVICT_AFTER_PROBES` probes in a row, has its streams moved elsewhere; one that stalls, or
  answers no probe at all for `stall_timeout`, is reported hung (`on_stall`: a local worker is
  restarted).
- Failover: a request whose member fails before the first event (unreachable, 503, a broken
  connection) goes to the next member; a refusal (a 400) is the request's own fault and is not
  retried. A run whose member dies or is taken out mid-stream continues on another member from
  the exact token (adapters/pool_continuation.py); a run that cannot be continued ends with a
  `worker_failed` error event, never a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from adapters.base import Adapter, BackendFailed, BackendRejected, BackendUnavailable, ModelInfo
from adapters.events import ErrorEvent, Event
from adapters.pool_continuation import RunProgress
from adapters.pool_members import EVICT_AFTER_PROBES, Lease, Member, MemberLost, Probe
from adapters.pool_routing import Router
from adapters.requests import ChatRequest

log = structlog.get_logger("sluice.pool")
RETRIED = (BackendUnavailable, BackendFailed, MemberLost)
MIGRATION_WAIT = 30.0  # seconds a run waits for a member able to continue it (a restart)


def member_names(adapters: Sequence[Adapter]) -> list[str]:
    """Each member's name in metrics and logs: its adapter's, with `#2`, `#3`, … after one
    already taken (two `--upstream` servers of one model are both named after the model)."""
    seen: Counter[str] = Counter()
    names = []
    for adapter in adapters:
        seen[adapter.name] += 1
        n = seen[adapter.name]
        names.append(adapter.name if n == 1 else f"{adapter.name}#{n}")
    return names


def worker_failed() -> ErrorEvent:
    """The error a run ends with when its member failed and no other could continue it."""
    return ErrorEvent(
        "worker_failed",
        "The model worker serving this request failed, and the run could not be continued.",
    )


class PoolAdapter:
    def __init__(
        self,
        members: list[Adapter],
        name: str = "pool",
        *,
        model: str | None = None,
        routing: str = "affinity",
        stall_timeout: float = 10.0,
        probe_timeout: float = 0.8,
        migration_wait: float = MIGRATION_WAIT,
        on_stall: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`members` are started and closed by their owner, not by the pool (one adapter may
        serve several models, so be a member of several pools). `model`: the model id this pool
        serves (None: the first member's). `on_stall(member_name)`: a member is hung, its engine
        stalled with work or it answered no probe for `stall_timeout` (a local one can be
        restarted)."""
        if not members:
            raise ValueError("a pool needs at least one member")
        self.name = name
        self.model = model
        self.members = [Member(a, n) for a, n in zip(members, member_names(members), strict=True)]
        self.router = Router(routing)
        self.stall_timeout = stall_timeout
        self.probe_timeout = probe_timeout
        self.migration_wait = migration_wait
        self.on_stall = on_stall
        self.clock = clock
        self.migrations: Counter[str] = Counter()  # outcome → runs
        self._serving: dict[str, tuple[Lease, RunProgress]] = {}  # live request id → its stream
        self._changed = asyncio.Event()  # set when a probe finds a member back

    async def start(self) -> None:
        await self.ready()

    async def close(self) -> None:
        return None

    async def models(self) -> list[ModelInfo]:
        infos = await self.members[0].adapter.models()
        return [i for i in infos if self.model is None or i.id == self.model][:1]

    def unsupported_param(self, request: ChatRequest) -> str | None:
        """A parameter no member can honour (the others are routed around)."""
        refused = [m.adapter.unsupported_param(request) for m in self.members]
        return None if None in refused else refused[0]

    def capacity(self) -> int | None:
        """Runs this gateway may stream from the pool at once: the sum of its usable members'
        (flow control, design §12); None when one of them has no known bound."""
        now = self.clock()
        total = 0
        for member in self.members:
            if member.usable(now):
                capacity = member.capacity()
                if capacity is None:
                    return None
                total += capacity
        return total

    @property
    def affinity_routes(self) -> int:
        return self.router.affinity_routes

    # -- health ----------------------------------------------------------------------------------

    async def ready(self) -> bool:
        """Probe every member; whether any can take work."""
        results = await asyncio.gather(*(self._probe(m) for m in self.members))
        now = self.clock()
        for member, probe in zip(self.members, results, strict=True):
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
        return any(m.usable(now) for m in self.members)

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
        the next probe, until a probe finds it ready again (a restart still loading is not)."""
        for member in self.members:
            if member.name == name:
                member.healthy = False

    def snapshot(self) -> list[dict[str, Any]]:
        return [m.snapshot() for m in self.members]

    # -- routing ---------------------------------------------------------------------------------

    def choose(self, request: ChatRequest, tried: set[int], continuing: bool = False) -> int | None:
        """The index of the member to send `request` to, or None when none is left. A
        continuation goes only to members that can continue a run (our own workers)."""
        now = self.clock()
        usable = [
            i
            for i, m in enumerate(self.members)
            if i not in tried
            and m.usable(now)
            and m.adapter.unsupported_param(request) is None
            and (not continuing or getattr(m.adapter, "continues_runs", False))
        ]
        return None if not usable else self.router.choose(self.members, usable, request)

    async def _member_for_continuation(self, run: RunProgress) -> int | None:
        """A member to continue the run on, waiting up to `migration_wait` for one to come back
        (a restarted worker); None when none did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.migration_wait
        while (index := self.choose(run.request, set(), continuing=run.generated)) is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            self._changed.clear()
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return None
        return index

    # -- streaming -------------------------------------------------------------------------------

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        run = RunProgress(request)
        tried: set[int] = set()
        last: Exception = BackendUnavailable("No member of the pool can serve this model now.")
        index = self.choose(request, tried)
        while index is not None:
            tried.add(index)
            member = self.members[index]
            try:
                async for batch in self._stream_from(member, run, request_id):
                    yield batch
                return
            except RETRIED as exc:
                member.failed(self.clock())
                last = exc
                if not run.started:
                    log.warning("pool member failed a request", member=member.name, retry=True)
                    index = self.choose(request, tried)
                    continue
                if run.aborting:
                    raise  # the run is ending anyway: its driver reads no more
                if run.finished:
                    return  # choice 0 is whole: only its usage went missing
                index = await self._migrate(run, member)
                if index is None:
                    yield [worker_failed()]
                    return
            except BackendRejected:
                if not run.migrating:
                    raise
                self.migrations["failed"] += 1  # the continuation was refused
                yield [worker_failed()]
                return
        raise last

    async def _migrate(self, run: RunProgress, failed: Member) -> int | None:
        """The member that continues the run cut on `failed`; None, counted, when none can."""
        outcome = run.why_not_continued()
        index = None if outcome else await self._member_for_continuation(run)
        if index is None:
            self.migrations[outcome or "failed"] += 1
            log.error("run not continued", member=failed.name, outcome=outcome or "failed")
            return None
        run.migrations += 1
        run.migrating = True
        log.warning(
            "continuing run on another member",
            member=failed.name,
            to=self.members[index].name,
            tokens=len(run.ids),
        )
        return index

    async def _stream_from(
        self, member: Member, run: RunProgress, request_id: str
    ) -> AsyncIterator[list[Event]]:
        """One member's stream of the run, while this member has it."""
        lease = member.lease()
        self._serving[request_id] = (lease, run)
        counted = not run.migrating
        try:
            async with aclosing(member.adapter.stream(run.request, request_id)) as events:
                while True:
                    try:
                        batch = await lease.read(events)
                    except StopAsyncIteration:
                        return
                    if not counted:
                        counted = True
                        self.migrations["continued"] += 1
                    if batch := run.passed(batch):
                        yield batch
        finally:
            member.release(lease)
            if self._serving.get(request_id, (None,))[0] is lease:
                del self._serving[request_id]

    async def abort(self, request_id: str) -> bool:
        """Routed to the member streaming `request_id`; an id no member streams is False."""
        serving = self._serving.get(request_id)
        if serving is None:
            return False
        lease, run = serving
        run.aborting = True
        return await lease.member.adapter.abort(request_id)
