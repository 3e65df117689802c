"""Several adapters serving one model (design §6): each request goes to the member that serves
it best, and a dead or hung member costs the client nothing it can see.

- Routing: adapters/pool_routing.py (prefix affinity bounded by load, by default).
- Health: adapters/pool_health.py (the probe round every second, exits and restarts, streams
  moved off a member that stalls, goes silent or misses its probes).
- Failover: a request whose member fails before the first event (unreachable, 503, a broken
  connection) goes to the next member; a refusal (a 400) is the request's own fault and is not
  retried. A run whose member dies or is taken out mid-stream continues on another member from
  the exact token (adapters/pool_continuation.py); a run that cannot be continued ends with a
  `worker_failed` error event, never a hang.
- Token counts (`count_tokens`): the member a request would go to, else the next that counts.
- Embeddings (`embed`): routed like a request not yet started, among the members that serve
  them, and failed over the same way before the answer; there is no stream to continue.
- Breakers and the retry budget: each member has a circuit breaker (adapters/breaker.py) that
  takes it out of routing when its requests keep failing; a retry before the first event asks
  the gateway's retry budget first (adapters/retry_budget.py) and waits a jittered backoff. A
  retry the budget refuses ends the request with its own error, as if no other member were left.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from adapters.base import (
    Adapter,
    BackendFailed,
    BackendRejected,
    BackendUnavailable,
    ModelInfo,
)
from adapters.breaker import Breaker, BreakerPolicy
from adapters.events import ErrorEvent, Event
from adapters.pool_continuation import RunProgress
from adapters.pool_health import PoolHealth
from adapters.pool_members import Lease, Member, MemberLost
from adapters.pool_oneshots import PoolOneShots
from adapters.pool_routing import Router
from adapters.requests import ChatRequest
from adapters.retry_budget import RetryBudget, retry_reason

log = structlog.get_logger("sluice.pool")
RETRIED = (BackendUnavailable, BackendFailed, MemberLost)
MIGRATION_WAIT = 30.0  # seconds a run waits for a member able to continue it (a restart)
# a request every other member of which asked to wait (429/503 retry-after) waits this long at
# most for the first of them, rather than fail while they are about to take work again
RETRY_AFTER_WAIT = 5.0
# a timer may fire a fraction of a millisecond early (uvloop's keep whole milliseconds of the
# loop's own clock): a wait for a member's rest to end waits this much past it
TIMER_SLACK = 0.002


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


class PoolAdapter(PoolHealth, PoolOneShots):
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
        crash_looping: Callable[[str], bool] | None = None,
        breaker: BreakerPolicy | None = None,
        retry_budget: RetryBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`members` are started and closed by their owner, not by the pool (one adapter may
        serve several models, so be a member of several pools). `model`: the model id this pool
        serves (None: the first member's). `on_stall(member_name)`: a member is hung, its engine
        stalled with work or it answered no probe for `stall_timeout` (a local one can be
        restarted). `crash_looping(member_name)`: its supervisor's word that a member that
        exited keeps exiting, so it is not worth waiting for. `breaker`: when the members'
        circuit breakers open (the defaults: 5 failures in a row, or half of 10 or more in 10 s).
        `retry_budget`: the gateway's, shared by its pools (None: one of this pool's own)."""
        if not members:
            raise ValueError("a pool needs at least one member")
        self.name = name
        self.model = model
        self.members = [
            Member(a, n, breaker=Breaker(n, breaker))
            for a, n in zip(members, member_names(members), strict=True)
        ]
        self.budget = retry_budget or RetryBudget(clock=clock)
        self.router = Router(routing)
        self.stall_timeout = stall_timeout
        self.probe_timeout = probe_timeout
        self.migration_wait = migration_wait
        self.on_stall = on_stall
        self.crash_looping = crash_looping
        self.clock = clock
        self.migrations: Counter[str] = Counter()  # outcome → runs
        self._serving: dict[str, tuple[Lease, RunProgress]] = {}  # live request id → its stream
        self._changed = asyncio.Event()  # set when a probe finds a member back
        self._exited: set[str] = set()  # members whose process exited, not probed ready since
        self._exits: Counter[str] = Counter()  # member → exits its supervisor told of

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

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [m.snapshot(now) for m in self.members]

    # -- routing ---------------------------------------------------------------------------------

    def choose(
        self, request: ChatRequest, tried: set[int], run: RunProgress | None = None
    ) -> int | None:
        """The index of the member to send `request` to, or None when none is left. A run
        already generating goes only to members that can continue it (RunProgress)."""
        usable = self._usable(request, tried, run)
        return None if not usable else self.router.choose(self.members, usable, request)

    def _usable(
        self, request: ChatRequest, tried: set[int], run: RunProgress | None = None
    ) -> list[int]:
        """The members `choose` picks among (asking routes nothing). A run waiting for a member
        does not go back to one a request just failed on (`suspect`) before a probe passes."""
        now = self.clock()
        return [
            i
            for i, m in enumerate(self.members)
            if i not in tried
            and m.usable(now)
            and m.adapter.unsupported_param(request) is None
            and (run is None or (run.can_continue_on(m.adapter) and not m.suspect))
        ]

    async def _member_for_continuation(self, run: RunProgress) -> int | None:
        """A member to continue the run on, waiting up to `migration_wait` for one to come back
        (a restarted worker); None when none did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.migration_wait
        while (index := self.choose(run.original, set(), run)) is None:
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
        self.budget.requested(request_id)
        run = RunProgress(request)
        tried: set[int] = set()
        last: Exception = BackendUnavailable("No member of the pool can serve this model now.")
        index = await self._member_for(request, run, tried)
        while index is not None:
            tried.add(index)
            member = self.members[index]
            try:
                async for batch in self._stream_from(member, run, request_id):
                    yield batch
                return
            except RETRIED as exc:
                last = exc
                if not run.started:
                    index = await self._retry(run, tried, member, exc)
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
        if isinstance(last, MemberLost):  # taken out before its first event: the member failed
            raise BackendFailed("The model worker stopped answering.") from last
        raise last

    async def _member_for(
        self, request: ChatRequest, run: RunProgress, tried: set[int]
    ) -> int | None:
        """The next member for a run not yet started. When none is usable but one is restarting
        (its process died a moment ago), the first back within `migration_wait`: the run waits
        `queued` for it, bound by its queue deadline too, rather than fail (design §11)."""
        index = self.choose(request, tried)
        if index is None and self.restarting():
            index = await self._member_for_continuation(run)
        return index

    async def _retry(
        self, run: RunProgress, tried: set[int], failed: Member, exc: Exception
    ) -> int | None:
        """The member to send a run that failed on `failed` before its first event to next,
        after a backoff; None when no other is left, or the retry budget refuses one (the run
        then fails with `exc`, as with no other member)."""
        resting: set[int] = set()
        if not self._usable(run.original, tried) and not self.restarting():
            resting = self._resting()
            if not resting:
                log.warning("pool member failed a request", member=failed.name, retry=False)
                return None
        reason = retry_reason(exc)
        if not self.budget.allow(reason):
            log.warning("retry refused by the budget", member=failed.name, pool=self.name)
            return None
        log.warning("pool member failed a request", member=failed.name, retry=True, why=reason)
        if run.original.trace is not None:
            run.original.trace.event("sluice.retry", member=failed.name, reason=reason)
        wait = self.budget.backoff(len(tried))
        if resting:  # only members resting on a retry-after are left: the first back takes it
            back = min(self.members[i].rest_until for i in resting)
            wait = max(wait, back - self.clock() + TIMER_SLACK)
            tried -= resting
        await asyncio.sleep(wait)
        return await self._member_for(run.original, run, tried)

    def _resting(self) -> set[int]:
        """Members out of routing only for a retry-after that ends within RETRY_AFTER_WAIT."""
        now = self.clock()
        return {
            i
            for i, m in enumerate(self.members)
            if now < m.rest_until <= now + RETRY_AFTER_WAIT and m.healthy and not m.stalled
        }

    async def _migrate(self, run: RunProgress, failed: Member) -> int | None:
        """The member that continues the run cut on `failed`; None, counted, when none can."""
        outcome = run.why_not_continued()
        if outcome is None and not any(run.can_continue_on(m.adapter) for m in self.members):
            outcome = "not_continuable"  # no member of this pool could ever take it
        index = None if outcome else await self._member_for_continuation(run)
        if index is None:
            self.migrations[outcome or "failed"] += 1
            log.error("run not continued", member=failed.name, outcome=outcome or "failed")
            return None
        run.migrations += 1
        run.migrating = True
        if run.original.trace is not None:
            to, tokens = self.members[index].name, run.tokens
            run.original.trace.event("sluice.migration", member=failed.name, to=to, tokens=tokens)
        log.warning(
            "continuing run on another member",
            member=failed.name,
            to=self.members[index].name,
            tokens=run.tokens,
        )
        return index

    async def _stream_from(
        self, member: Member, run: RunProgress, request_id: str
    ) -> AsyncIterator[list[Event]]:
        """One member's stream of the run, while this member has it."""
        lease = member.lease(self.clock())
        self._serving[request_id] = (lease, run)
        counted = not run.migrating
        request = run.begin_on(member.adapter)
        try:
            async with aclosing(member.adapter.stream(request, request_id)) as events:
                task = asyncio.current_task()
                while True:
                    cancels = lease.reading(task)
                    try:
                        batch = await anext(events)
                    except StopAsyncIteration:
                        return
                    except asyncio.CancelledError:
                        if lease.lost(task, cancels):
                            raise MemberLost(member.name) from None
                        raise
                    finally:
                        lease.reading(None)
                    now = self.clock()
                    member.served(lease, batch, now)
                    if not counted:
                        counted = True
                        self.migrations["continued"] += 1
                    batch = run.passed(batch)
                    if run.generated and not member.reported:
                        lease.heard = now  # watched mid-stream (_evict_silent)
                    if batch:
                        yield batch
        except RETRIED as exc:
            member.failed(self.clock(), lease, exc)  # its breaker counts it
            raise
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
