"""Flow control (design §12): when a model's backend is saturated, new runs wait in this gateway,
in per-tenant queues inside tier bands, and are dispatched by weighted fair queuing over tokens
(policies/fair_queue.py) as capacity frees.

One `FlowControl` per routed backend (a pool, an OpenAI-compatible upstream). Its capacity is the
backend's own (`capacity_of`): for our workers, two batches per engine as they report it, less
what other replicas run there; for an upstream, the `capacity` it was configured with. A backend
with no known capacity is never saturated here (its runs go at once; our workers still schedule
fairly inside). The count against it is this gateway's own: runs dispatched and not yet over.

A run's `Ticket` is taken when its request is admitted, before the run starts: dispatched at
once when nothing waits and capacity is free, else queued, or refused with `Shed` (a 429) when
its tenant already has `max_queued` runs waiting. A full queue makes room for a `default` or
`priority` run by shedding the tenant's newest `flex` run; a `flex` run finds no room. The
run's driver waits on the ticket (the run is `queued` meanwhile: retrievable, cancellable,
resumable, bound by its queue deadline), withdraws it when the run ends while waiting, and
releases it when the run stops using the backend, with what it really used.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections import deque
from collections.abc import Callable

from adapters.base import Adapter
from gateway.metrics import GatewayMetrics
from policies.fair_queue import FairQueue, Waiting
from wire.share import Share

RECHECK_S = 0.25  # a saturated backend's capacity is looked at again this often (probes move it)
RATE_WINDOW_S = 10.0  # dispatches counted over this window estimate when a shed run may retry


class Shed(Exception):
    """The run's tenant has too many runs waiting: refused (429), or evicted for a run of a
    higher tier. `retry_after` is an estimate of when its queue has room again."""

    def __init__(self, tier: str, retry_after: float) -> None:
        super().__init__(f"the {tier} queue is full")
        self.tier = tier
        self.retry_after = retry_after


class Withdrawn(Exception):
    """The run left the queue before its turn (cancelled, timed out)."""


class TicketState(enum.Enum):
    NEW = "new"
    QUEUED = "queued"  # waiting for capacity
    DISPATCHED = "dispatched"  # its run may use the backend
    RELEASED = "released"  # its run is done with the backend
    WITHDRAWN = "withdrawn"  # it left the queue (cancelled, timed out)
    SHED = "shed"  # a run of a higher tier took its place


def capacity_of(backend: Adapter) -> int | None:
    """How many runs this gateway may have streaming from `backend` now; None: no bound known."""
    capacity: Callable[[], int | None] | None = getattr(backend, "capacity", None)
    return None if capacity is None else capacity()


class Ticket:
    """A run's place in its backend's flow control."""

    __slots__ = ("_future", "flow", "prompt", "queued_at", "share", "state", "tenant", "waiting")

    def __init__(
        self, flow: FlowControl, run_id: str, tenant: str, share: Share, prompt: int, cost: int
    ) -> None:
        """`prompt` is the prompt's estimate (until the backend says), `cost` that plus the
        tokens the run may generate."""
        self.flow = flow
        self.tenant = tenant  # the tenant's name (a metrics label the tenants file bounds)
        self.share = share
        self.prompt = prompt
        self.waiting = Waiting(run_id, tenant, share.weight, share.tier, cost)
        self.queued_at = flow.clock()
        self.state = TicketState.NEW  # → QUEUED → DISPATCHED → RELEASED; QUEUED → WITHDRAWN | SHED
        self._future: asyncio.Future[None] | None = None

    @property
    def dispatched(self) -> bool:
        return self.state in (TicketState.DISPATCHED, TicketState.RELEASED)

    async def wait(self) -> None:
        """Until the run's turn; raises Shed (evicted) or Withdrawn."""
        if self.state is TicketState.QUEUED:
            if self._future is None:
                self._future = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._future)
        elif self.state is TicketState.SHED:
            raise Shed(self.share.tier, self.flow.retry_after())
        elif self.state is TicketState.WITHDRAWN:
            raise Withdrawn

    def withdraw(self) -> None:
        """Leave the queue (idempotent; nothing once dispatched)."""
        if self.state is TicketState.QUEUED:
            self.flow.leave(self)
            self._resolve(TicketState.WITHDRAWN, Withdrawn())

    def done(self, prompt_tokens: int | None, generated_tokens: int) -> None:
        """The run no longer uses the backend (or never will): its capacity goes back, and its
        tenant is charged what it used. Idempotent; a queued run is withdrawn."""
        if self.state is TicketState.DISPATCHED:
            self.state = TicketState.RELEASED
            self.flow.release(self, prompt_tokens, generated_tokens)
        else:
            self.withdraw()

    def _resolve(self, state: TicketState, error: BaseException | None = None) -> None:
        self.state = state
        if self._future is not None and not self._future.done():
            if error is None:
                self._future.set_result(None)
            else:
                self._future.set_exception(error)
                self._future.exception()  # retrieved: a run that never waited logs nothing


class FlowControl:
    def __init__(
        self,
        backend: Adapter,
        metrics: GatewayMetrics,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`enabled` False (`--scheduling fcfs`): every run goes at once, as they come."""
        self.backend = backend
        self.metrics = metrics
        self.enabled = enabled
        self.clock = clock
        self.queue = FairQueue()
        self.in_flight = 0  # this gateway's runs dispatched to the backend and not over
        self._tickets: dict[str, Ticket] = {}  # waiting, by run id
        self._dispatches: deque[float] = deque()  # when, over the last RATE_WINDOW_S
        self._timer: asyncio.TimerHandle | None = None

    def admit(
        self, run_id: str, tenant: str, share: Share, max_queued: int, prompt: int, cost: int
    ) -> Ticket:
        """The run's ticket: dispatched at once, or queued; raises Shed when its tenant's queue
        is full and has no `flex` run to give up for it."""
        ticket = Ticket(self, run_id, tenant, share, prompt, cost)
        if self.at_once():
            self.queue.went_at_once(ticket.waiting)  # its tenant's account counts it all the same
            self._dispatch(ticket)
            return ticket
        if self.queue.queued(tenant) >= max_queued:
            victim = None if share.tier == "flex" else self.queue.newest(tenant, "flex")
            if victim is None:
                self.metrics.shed.labels(share.tier).inc()
                raise Shed(share.tier, self.retry_after())
            shed = self._tickets[victim.key]
            self.leave(shed)
            self.metrics.shed.labels("flex").inc()
            shed._resolve(TicketState.SHED, Shed("flex", self.retry_after()))
        ticket.state = TicketState.QUEUED
        self._tickets[run_id] = ticket
        self.queue.push(ticket.waiting)
        self.metrics.queue_depth.labels(tenant, share.tier).inc()
        self._dispatch_waiting()
        return ticket

    def at_once(self) -> bool:
        """Whether a run admitted now goes at once (nothing waits and capacity is free); a
        request that may not wait (`x-sluice-no-wait`) is refused when it would not."""
        return not self.enabled or (not self.queue and self._free() > 0)

    def leave(self, ticket: Ticket) -> None:
        """A queued ticket leaves the queue (withdrawn or shed)."""
        if self.queue.remove(ticket.waiting.key) is not None:
            del self._tickets[ticket.waiting.key]
            self.metrics.queue_depth.labels(ticket.tenant, ticket.share.tier).dec()

    def release(self, ticket: Ticket, prompt_tokens: int | None, generated: int) -> None:
        """A dispatched run is over: settle its tenant's account, dispatch who waits."""
        self.in_flight -= 1
        w = ticket.waiting
        prompt = ticket.prompt if prompt_tokens is None else prompt_tokens
        self.queue.settle(ticket.tenant, w.weight, w.cost, prompt + generated)
        self.metrics.tokens_served.labels(ticket.tenant).inc(generated)
        self._dispatch_waiting()

    def retry_after(self) -> float:
        """Seconds until the queue has likely moved on: its length over the recent dispatch
        rate, from 1 to 60."""
        now = self.clock()
        while self._dispatches and self._dispatches[0] < now - RATE_WINDOW_S:
            self._dispatches.popleft()
        rate = len(self._dispatches) / RATE_WINDOW_S
        return 60.0 if rate == 0 else min(60.0, max(1.0, len(self.queue) / rate))

    def _free(self) -> float:
        capacity = capacity_of(self.backend)
        return math.inf if capacity is None else capacity - self.in_flight

    def _dispatch(self, ticket: Ticket) -> None:
        self.in_flight += 1
        now = self.clock()
        self._dispatches.append(now)
        share = ticket.share
        self.metrics.queue_wait.labels(ticket.tenant, share.tier).observe(now - ticket.queued_at)
        ticket._resolve(TicketState.DISPATCHED)

    def _dispatch_waiting(self) -> None:
        """Dispatch waiting runs, best first, while capacity is free; while some still wait,
        look again shortly (the backend's capacity moves with its members' reports)."""
        while self.queue and self._free() > 0:
            waiting = self.queue.pop()
            ticket = self._tickets.pop(waiting.key)
            self.metrics.queue_depth.labels(ticket.tenant, ticket.share.tier).dec()
            self._dispatch(ticket)
        if self.queue and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        self._dispatch_waiting()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Flows:
    """Every backend's flow control, made on first use."""

    def __init__(self, metrics: GatewayMetrics, *, enabled: bool = True) -> None:
        self.metrics = metrics
        self.enabled = enabled
        self._flows: dict[int, FlowControl] = {}

    def of(self, backend: Adapter) -> FlowControl:
        flow = self._flows.get(id(backend))
        if flow is None:
            flow = self._flows[id(backend)] = FlowControl(
                backend, self.metrics, enabled=self.enabled
            )
        return flow

    def close(self) -> None:
        for flow in self._flows.values():
            flow.close()
