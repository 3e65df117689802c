"""Fair scheduling inside the engine (design §12): which waiting sequence goes next, and which
running one yields to it.

- **Order.** Waiting sequences go by tier (`priority`, `default`, `flex`), then those whose
  tenant is under its weighted share of the tier's slots first, then by their tenant's virtual
  time (the tokens the engine computed for it, divided by its weight), then by how many
  sequences the tenant runs per unit of weight, then by arrival. (Virtual time alone lags:
  when a slot frees, a tenant that fell short of its share may still have spent more per unit
  of weight over the whole run, and would wait for the other to catch up; the share test
  gives the slot to whoever is short now.) A tenant that becomes active starts at the least
  virtual time among the active ones: an idle tenant banks no credit, and a returning one does
  not pay for what it used before it left.
- **Yielding.** When the head of that order cannot start (the batch is full, or its blocks are
  not free), a running sequence yields to it (preempted by recompute) if it is of a lower tier
  (reason `priority`), or if the head's tenant is under its weighted share of the tier's slots
  while another tenant is over its own (reason `fairness`; the victim is the most over-served
  tenant's newest sequence). Shares count the tenants with work in the tier, so an idle
  tenant's share goes to the busy ones.
- **The bound.** A sequence yields at most `MAX_YIELDS` (1) times. A yield costs the victim a
  recompute of its prompt and output (their full blocks mostly come back from the prefix cache)
  and a wait; once is enough to hand a slot over at the next step boundary, and a sequence that
  has yielded once is never taken again, so every sequence finishes, and the work the policy can
  waste is at most one recompute per request. The share test is strict on both sides (the
  head's tenant must stay within its share after it starts, the victim's must be over its own),
  so two tenants never trade a slot back and forth.
- **Blocks.** When a running sequence needs a block and none is free, the victim is the lowest
  tier's, most over-served tenant's newest sequence among those not yet given work this step
  (with one tenant: the newest, as before). These `kv` preemptions are forced, and not counted
  against the bound.

With `fair` off (`sluice worker --scheduling fcfs`) the order is arrival, nothing yields, and
block shortages preempt the newest sequence: the engine as it was before fair scheduling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.request import SequenceState

MAX_YIELDS = 1
PREEMPTION_REASONS = ("kv", "fairness", "priority")


class FairPolicy:
    """The engine's sharing policy: one per scheduler, consulted at each step boundary."""

    def __init__(self, max_num_seqs: int, fair: bool = True) -> None:
        self.max_num_seqs = max_num_seqs
        self.fair = fair
        self._vtime: dict[str, float] = {}  # active tenant → its virtual time
        self._live: Counter[str] = Counter()  # active tenant → its live sequences

    # -- bookkeeping ------------------------------------------------------------------------------

    def entered(self, seq: SequenceState) -> None:
        """A sequence became live (queued or forked)."""
        tenant = seq.share.tenant
        if self._live[tenant] == 0:
            others = [v for t, v in self._vtime.items() if self._live[t] > 0]
            self._vtime[tenant] = min(others, default=0.0)
        self._live[tenant] += 1

    def left(self, seq: SequenceState) -> None:
        """A live sequence ended; a tenant with none left is forgotten (it banks nothing)."""
        tenant = seq.share.tenant
        self._live[tenant] -= 1
        if self._live[tenant] <= 0:
            del self._live[tenant]
            self._vtime.pop(tenant, None)

    def served(self, work: Iterable[tuple[SequenceState, int]]) -> None:
        """A step computed these tokens: each tenant's virtual time moves by tokens / weight."""
        for seq, tokens in work:
            tenant = seq.share.tenant
            if tenant in self._vtime:
                self._vtime[tenant] += tokens / seq.share.weight

    def vtime(self, tenant: str) -> float:
        return self._vtime.get(tenant, 0.0)

    # -- decisions --------------------------------------------------------------------------------

    def order(
        self, waiting: Sequence[SequenceState], running: Sequence[SequenceState]
    ) -> list[SequenceState]:
        """The waiting sequences in the order they may start (`waiting` is in arrival order,
        sequences preempted for blocks at its front)."""
        if not self.fair or len(waiting) < 2:
            return list(waiting)
        standing = Standing(running, waiting, self.max_num_seqs)
        return sorted(
            waiting,
            key=lambda s: (
                s.share.rank,
                not standing.under(s, 1),
                self.vtime(s.share.tenant),
                standing.per_weight(s),
            ),
        )  # stable: arrival breaks the remaining ties

    def victim(
        self,
        head: SequenceState,
        need: int,
        running: Sequence[SequenceState],
        waiting: Sequence[SequenceState],
    ) -> tuple[SequenceState, str] | None:
        """The running sequence that yields to `head` (which needs `need` slots) and why
        (`priority` or `fairness`), or None when none should."""
        if not self.fair:
            return None
        lower = [s for s in running if s.share.rank > head.share.rank and s.yields < MAX_YIELDS]
        if lower:
            rank = max(s.share.rank for s in lower)
            return _newest(s for s in lower if s.share.rank == rank), "priority"
        standing = Standing(running, waiting, self.max_num_seqs)
        if not standing.under(head, need):
            return None  # the head's tenant has its share already
        over = [
            s
            for s in running
            if s.share.rank == head.share.rank and s.yields < MAX_YIELDS and standing.over(s)
        ]
        if not over:
            return None
        worst = max(over, key=standing.per_weight)
        return _newest(s for s in over if s.share.tenant == worst.share.tenant), "fairness"

    def block_victim(
        self, candidates: Sequence[SequenceState], running: Sequence[SequenceState]
    ) -> SequenceState:
        """Of `candidates`, the running sequences not yet given work this step (in schedule
        order, not empty), the one whose blocks go to a sequence that needs one."""
        if not self.fair:
            return candidates[-1]
        standing = Standing(running, (), self.max_num_seqs)
        position = {id(s): i for i, s in enumerate(candidates)}
        return max(
            candidates,
            key=lambda s: (s.share.rank, standing.per_weight(s), position[id(s)]),
        )


class Standing:
    """Where each tenant stands in each tier now: the sequences it runs there, and its weighted
    share of the slots the higher tiers leave, among the tenants with work in the tier (so an
    idle tenant's share goes to the busy ones)."""

    def __init__(
        self,
        running: Sequence[SequenceState],
        waiting: Sequence[SequenceState],
        max_num_seqs: int,
    ) -> None:
        self.counts: Counter[tuple[int, str]] = Counter(_where(s) for s in running)
        weights: dict[tuple[int, str], float] = {}
        for seq in (*running, *waiting):
            weights[_where(seq)] = seq.share.weight  # the latest request's weight
        by_rank = Counter(s.share.rank for s in running)
        self.shares: dict[tuple[int, str], float] = {}
        for rank in {r for r, _ in weights}:
            slots = max_num_seqs - sum(n for r, n in by_rank.items() if r < rank)
            total = sum(w for (r, _), w in weights.items() if r == rank)
            for where, w in weights.items():
                if where[0] == rank:
                    self.shares[where] = slots * w / total

    def under(self, seq: SequenceState, need: int) -> bool:
        """Whether its tenant stays within its share in its tier with `need` more slots."""
        where = _where(seq)
        return self.counts[where] + need <= self.shares.get(where, 0.0)

    def over(self, seq: SequenceState) -> bool:
        """Whether its tenant runs more than its share in its tier."""
        where = _where(seq)
        return self.counts[where] > self.shares.get(where, 0.0)

    def per_weight(self, seq: SequenceState) -> float:
        """Its tenant's sequences running in its tier, per unit of its weight."""
        return self.counts[_where(seq)] / seq.share.weight


def _where(seq: SequenceState) -> tuple[int, str]:
    return seq.share.rank, seq.share.tenant


def _newest(seqs: Iterable[SequenceState]) -> SequenceState:
    """The last of `seqs` in the running list's order: the one admitted most recently."""
    *_, last = seqs
    return last
