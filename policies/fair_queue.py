"""Weighted fair queuing over tokens, inside tier bands (design §12): which waiting run a
saturated model dispatches next.

Each tenant has a first-in-first-out queue per service tier. The highest tier with a run waiting
goes first (`priority`, then `default`, then `flex`): strictly, so flex is served only when
nothing above it waits. Within a tier, runs go by virtual finish time (start-time fair queuing
over tokens): a run's virtual start is where its tenant's previous run finishes, or the system's
virtual time when it arrived if that is later, and it finishes `cost / weight` after; the run
with the earliest finish goes first. A run's cost is its prompt estimate plus the tokens it may
generate; when it ends, its tenant is charged what it really used instead (`settle`), so a run
that stopped early does not count against its tenant as if it had run to `max_tokens`.

Work-conserving by construction: whenever capacity frees, some waiting run is dispatched; a
tenant with nothing waiting takes no turn, and one that comes back after idling starts at the
system's virtual time (it banks no credit for the time it was away, and pays no debt).

Pure and synchronous: the gateway's flow control (gateway/runs/flow_control.py) owns the tickets and
the clocks; this only decides the order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import count

from wire.share import TIER_RANK


@dataclass(slots=True, eq=False)
class Waiting:
    """One run waiting for capacity, with its virtual start and finish (set by the queue)."""

    key: str  # the run's id
    tenant: str
    weight: float
    tier: str
    cost: float  # tokens it may use: prompt estimate + max_tokens * n
    seq: int = 0  # arrival order
    arrived: float = 0.0  # the system's virtual time when it arrived
    start: float = 0.0
    finish: float = 0.0


class FairQueue:
    def __init__(self) -> None:
        self._queues: dict[tuple[int, str], deque[Waiting]] = {}  # (tier rank, tenant) → FIFO
        self._tenants: dict[str, list[Waiting]] = {}  # tenant → its waiting runs, in arrival order
        self._done: dict[str, float] = {}  # tenant → virtual finish of its dispatched runs
        self._vtime = 0.0  # the system's virtual time: the latest dispatch's virtual start
        self._by_key: dict[str, Waiting] = {}
        self._arrivals = count()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def depth(self, tenant: str, tier: str) -> int:
        return len(self._queues.get((TIER_RANK[tier], tenant), ()))

    def queued(self, tenant: str) -> int:
        """The tenant's runs waiting, in every tier."""
        return len(self._tenants.get(tenant, ()))

    def push(self, waiting: Waiting) -> None:
        waiting.seq, waiting.arrived = next(self._arrivals), self._vtime
        runs = self._tenants.setdefault(waiting.tenant, [])
        previous = runs[-1].finish if runs else self._done.get(waiting.tenant, self._vtime)
        waiting.start = max(self._vtime, previous)
        waiting.finish = waiting.start + waiting.cost / waiting.weight
        runs.append(waiting)
        self._queues.setdefault((TIER_RANK[waiting.tier], waiting.tenant), deque()).append(waiting)
        self._by_key[waiting.key] = waiting

    def went_at_once(self, waiting: Waiting) -> None:
        """A run dispatched without waiting (nothing waited, capacity was free): its tenant's
        account is charged as if it had been queued and popped at once."""
        self.push(waiting)
        self._take(waiting)
        self._dispatched(waiting)

    def pop(self) -> Waiting | None:
        """The run to dispatch now: in the highest tier waiting, the earliest virtual finish
        (then the earliest arrival); None when nothing waits."""
        if not self._queues:
            return None
        band = min(rank for rank, _ in self._queues)
        heads = [q[0] for (rank, _), q in self._queues.items() if rank == band]
        waiting = min(heads, key=lambda w: (w.finish, w.seq))
        self._take(waiting)
        self._dispatched(waiting)
        return waiting

    def _dispatched(self, waiting: Waiting) -> None:
        self._vtime = max(self._vtime, waiting.start)
        self._done[waiting.tenant] = max(self._done.get(waiting.tenant, 0.0), waiting.finish)
        self._forget_idle()

    def remove(self, key: str) -> Waiting | None:
        """Take a waiting run out (cancelled, timed out, shed): the tenant's later runs move up
        into the virtual time it held. None when it is not waiting."""
        waiting = self._by_key.get(key)
        if waiting is None:
            return None
        self._take(waiting)
        self._rechain(waiting.tenant)
        return waiting

    def newest(self, tenant: str, tier: str) -> Waiting | None:
        """The tenant's latest arrival in `tier`: the one a full queue sheds."""
        queue = self._queues.get((TIER_RANK[tier], tenant))
        return queue[-1] if queue else None

    def settle(self, tenant: str, weight: float, charged: float, used: float) -> None:
        """A dispatched run ended having used `used` tokens where `charged` were counted: the
        tenant's account (and so its waiting runs' places) moves by the difference."""
        done = self._done.get(tenant, self._vtime)
        self._done[tenant] = done + (used - charged) / weight
        self._rechain(tenant)

    def _take(self, waiting: Waiting) -> None:
        where = (TIER_RANK[waiting.tier], waiting.tenant)
        self._queues[where].remove(waiting)
        if not self._queues[where]:
            del self._queues[where]
        runs = self._tenants[waiting.tenant]
        runs.remove(waiting)
        if not runs:
            del self._tenants[waiting.tenant]
        del self._by_key[waiting.key]

    def _rechain(self, tenant: str) -> None:
        """Each waiting run of the tenant starts where its previous one finishes, or where the
        system was when it arrived, whichever is later."""
        previous = self._done.get(tenant)
        for waiting in self._tenants.get(tenant, ()):
            waiting.start = waiting.arrived if previous is None else max(waiting.arrived, previous)
            waiting.finish = previous = waiting.start + waiting.cost / waiting.weight

    def _forget_idle(self) -> None:
        """A tenant with nothing waiting whose finish is behind the system's virtual time would
        start at the system's time anyway: its account says nothing more."""
        for tenant in [t for t, f in self._done.items() if f <= self._vtime]:
            if tenant not in self._tenants:
                del self._done[tenant]
