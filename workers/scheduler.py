"""Owns the queues: which sequences run this step and how many new tokens each computes.

Every step mixes the running sequences' work (a decode is one new token; a prompt still being
prefilled takes a chunk) with newly admitted sequences, under a token budget
(`max_num_batched_tokens`) and a cap on running sequences (`max_num_seqs`). A sequence is admitted
only when the block manager has blocks for all its tokens. When a running sequence needs a block
and none is free, the newest running sequence is preempted: its blocks are freed, its computed
tokens forgotten, and it goes back to the front of the queue to be recomputed later (its full
blocks usually come straight back from the prefix cache).

Decodes always go first. With a step-time target (`StepBudget`, step_time.py), prefill gets only
the tokens that still fit under the target after the decodes, so a long prompt is split into
chunks small enough that the running sequences keep their token cadence (the cadence of those
already streaming: while no decode has settled, a burst of prompts takes the fixed budget);
without one, prefill takes whatever the fixed token budget leaves. Optional work (speculative
drafts) is added after the schedule and gets only `spare_tokens`: what is still left under the
target after the decodes and prefill, so a step with drafts runs no longer than one without.

Which waiting sequence starts next, and which running one yields its slot or blocks to it, is
the sharing policy's (fair_policy.py): by tier, then by tenant under weighted fair sharing, or in
arrival order with `fcfs`. Yields happen at the start of a step, before any sequence is given
work, and are counted by reason (`kv`, `fairness`, `priority`).

The scheduler owns the block manager: the engine asks it to admit, fork and release sequences
and to record what a step computed, and never touches blocks itself (nano-vllm's split).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from workers.block_manager import BlockManager
from workers.fair_policy import FairPolicy
from workers.request import RequestStatus, SequenceState
from workers.step_time import SETTLED_TOKENS, StepBudget


@dataclass(slots=True, frozen=True)
class Fork:
    """How a choice started from its leader's computed prompt: `running` when it shares the
    leader's blocks now (after the caller copies the `copy` block, (src, dst), if any), else
    queued to compute the prompt itself (blocks ran short)."""

    running: bool
    copy: tuple[int, int] | None = None


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    waiting: int  # requests
    running: int
    preemptions: dict[str, int]  # reason (kv, fairness, priority) → sequences preempted
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hits: int
    prefix_cache_queries: int


@dataclass(slots=True)
class ScheduledStep:
    """This step's work: (sequence, new tokens) pairs, in schedule order."""

    work: list[tuple[SequenceState, int]] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)  # for blocks, this step
    yielded: list[SequenceState] = field(default_factory=list)  # to a waiting one, this step
    decodes: int = 0  # the first `decodes` of `work` are running sequences' one-token decodes
    # False: prefill took the whole budget beside decodes that had not settled (step_time.py)
    shaped: bool = True
    drafts: int = 0  # speculative draft tokens added after the schedule (in `work`'s counts)
    replayed: bool = False  # it ran as one CUDA graph replay, not eagerly (decode_graphs.py)
    alone: bool = False  # its decodes run alone, no drafts either: the cadence's measure

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_budget: StepBudget | None = None,
        fair: bool = True,
    ) -> None:
        """`fair` False: arrival order, and nothing yields (fair_policy.py)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_budget = step_budget  # None: prefill takes what the fixed budget leaves
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.policy = FairPolicy(max_num_seqs, fair)
        self.preempted_by: Counter[str] = Counter()  # reason → sequences preempted

    @property
    def preemptions(self) -> int:
        return sum(self.preempted_by.values())

    def add(self, seq: SequenceState) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)
        self.policy.entered(seq)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` could ever be held by the whole cache."""
        return self.blocks.blocks_for(num_tokens) <= self.blocks.num_blocks

    def fork(self, leader: SequenceState, child: SequenceState) -> Fork:
        """Start `child` from `leader`, which just computed their shared prompt."""
        if not self.blocks.can_fork(leader):  # the leader's admission reserved the slots only
            self.add(child)  # computes the prompt itself, mostly from the prefix cache
            return Fork(running=False)
        partial = self.blocks.fork(leader, child)
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self.policy.entered(child)
        return Fork(True, None if partial is None else (partial, child.block_table[-1]))

    def computed(self, work: list[tuple[SequenceState, int]]) -> None:
        """A step ran: its sequences computed their new tokens, whose full blocks are now
        findable in the prefix cache."""
        for seq, new in work:
            seq.num_computed_tokens += new
            self.blocks.register_computed(seq)
        self.policy.served(work)

    def stats(self) -> SchedulerStats:
        b = self.blocks
        return SchedulerStats(
            waiting=len({s.request_id for s in self.waiting}),
            running=len({s.request_id for s in self.running}),
            preemptions=dict(self.preempted_by),
            kv_blocks_used=b.num_used,
            kv_blocks_total=b.num_blocks,
            prefix_cache_hits=b.prefix_hits,
            prefix_cache_queries=b.prefix_queries,
        )

    @staticmethod
    def _slots(seq: SequenceState) -> int:
        """A prompt with `n` choices holds a slot for each sibling that will fork from it."""
        return seq.params.n if seq.index == 0 and not seq.output_ids else 1

    def has_room(self, seq: SequenceState | None = None) -> bool:
        """Whether `seq` (or one more sequence) may run within `max_num_seqs`."""
        used = sum(self._slots(s) for s in self.running)
        need = 1 if seq is None else self._slots(seq)
        return not self.running or used + need <= self.max_num_seqs

    def release(self, seq: SequenceState) -> None:
        """Remove a finished or aborted sequence and release its blocks (idempotent)."""
        if seq in self.running:
            self.running.remove(seq)
            self.policy.left(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.policy.left(seq)
        if seq.block_table:
            self.blocks.free(seq)

    def reserve(self, seq: SequenceState, num_tokens: int) -> bool:
        """Grow a scheduled sequence to hold `num_tokens` from free blocks alone, never
        preempting: for optional work (a speculative draft); False when they are not free."""
        if not self.blocks.can_grow(seq, num_tokens):
            return False
        self.blocks.grow(seq, num_tokens)
        return True

    def schedule(self) -> ScheduledStep:
        """This step's work: every decode that fits, then prefill chunks within what is left."""
        step = ScheduledStep()
        admitting = self._yield_to_waiting(step)
        # NOTE: decodes first, then prompts being prefilled, each group oldest first; a sequence
        # short of blocks preempts from the end of that order (the newest prompt, else the newest
        # decode), never one already given work this step.
        order = [s for s in self.running if s.num_uncomputed == 1]
        settled = sum(len(s.output_ids) >= SETTLED_TOKENS for s in order)
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        prompts = len(prefilling) + len(self.waiting)  # waiting for their first token
        order += prefilling
        budget = self.max_num_batched_tokens
        prefill = None  # decided once the decodes are in
        # decodes alone now and then, to measure their cadence (step_time.py, CADENCE_EVERY); not
        # on a step where a sequence yielded its place to a waiting one, which starts now
        step.alone = (
            not step.yielded
            and settled > 0
            and self.step_budget is not None
            and self.step_budget.cadence_due()
        )
        embed = _EmbeddingRoom(self, step)
        i = 0
        while i < len(order) and budget > 0:
            seq = order[i]
            if prefill is None and seq.num_uncomputed > 1:
                prefill = self._prefill_room(step, budget, prompts, settled)
            new = min(seq.num_uncomputed, budget if prefill is None else prefill)
            new = embed.take(seq, new, budget)
            if new == 0:
                if seq.embedding is not None:
                    i += 1  # the embeddings' share is spent; a prompt after it may still go
                    continue
                break
            if not self._make_room(step, order, i, seq.num_computed_tokens + new):
                break
            step.work.append((seq, new))
            budget -= new
            if prefill is None:
                step.decodes += 1
            else:
                prefill -= new
            i += 1
        if not step.preempted:
            if prefill is None:
                prefill = self._prefill_room(step, budget, prompts, settled)
            self._admit(step, min(budget, prefill), admitting, embed)
        step.shaped = settled > 0 or step.num_tokens == step.decodes
        if self.step_budget is not None and step.work:
            self.step_budget.started()
        return step

    def spare_tokens(self, step: ScheduledStep) -> int:
        """Tokens `step` may still take for optional work (speculative drafts): what the fixed
        budget leaves, and with a step-time target no more than still fits under it; none on a
        step whose decodes run alone."""
        limit = 0 if step.alone else max(0, self.max_num_batched_tokens - step.num_tokens)
        if self.step_budget is None or not step.work:
            return limit
        return self.step_budget.spare_tokens(step.num_tokens, limit, step.decodes)

    def step_ended(self, step: ScheduledStep) -> None:
        """The step's results are back on the host: the step-time target learns its cost."""
        if self.step_budget is not None and step.work:
            self.step_budget.ended(
                step.num_tokens, step.decodes, step.shaped, step.drafts, step.replayed
            )

    def _prefill_room(self, step: ScheduledStep, budget: int, prompts: int, settled: int) -> int:
        if step.alone:
            return 0
        if self.step_budget is None:
            return budget
        return self.step_budget.prefill_tokens(step.num_tokens, budget, prompts, settled)

    def _make_room(
        self, step: ScheduledStep, order: list[SequenceState], i: int, target: int
    ) -> bool:
        """Grow `order[i]` to `target` tokens, preempting for blocks from the sequences after
        it in `order` (the policy picks which); False when it was preempted itself (it was the
        last one left)."""
        seq = order[i]
        while not self.blocks.can_grow(seq, target) and order[-1] is not seq:
            victim = self.policy.block_victim(order[i + 1 :], self.running)
            order.remove(victim)
            step.preempted.append(self._preempt(victim, "kv"))
        if not self.blocks.can_grow(seq, target):
            step.preempted.append(self._preempt(order.pop(), "kv"))
            return False
        self.blocks.grow(seq, target)
        return True

    def _yield_to_waiting(self, step: ScheduledStep) -> list[SequenceState]:
        """The waiting sequences in the order they may start; before that, running sequences
        that yield to its head (a higher tier, or a tenant under its share) are preempted."""
        order = self.policy.order(self.waiting, self.running)
        if not order:
            return order
        head = order[0]
        while not (self.has_room(head) and self.blocks.can_allocate(head)):
            found = self.policy.victim(head, self._slots(head), self.running, self.waiting)
            if found is None:
                break
            victim, reason = found
            victim.yields += 1
            step.yielded.append(self._preempt(victim, reason))
        return self.policy.order(self.waiting, self.running) if step.yielded else order

    def _admit(
        self,
        step: ScheduledStep,
        budget: int,
        order: list[SequenceState],
        embed: _EmbeddingRoom,
    ) -> None:
        """Start waiting sequences in `order` while they fit; the first that does not, waits
        (and so do those after it: none overtakes it)."""
        for seq in order:
            if budget <= 0 or not self.has_room(seq) or not self.blocks.can_allocate(seq):
                break
            new = embed.take(seq, min(seq.num_uncomputed, budget), budget)
            if new == 0:
                break
            self.waiting.remove(seq)
            self.blocks.allocate(seq)
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            new = embed.take(seq, min(seq.num_uncomputed, budget), budget, spend=True)
            step.work.append((seq, new))
            budget -= new

    def _preempt(self, seq: SequenceState, reason: str) -> SequenceState:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)
        self.preempted_by[reason] += 1
        return seq


EMBED_FLOOR = 4  # the fewest tokens an embedding's chunk takes beside decodes (_EmbeddingRoom)


class _EmbeddingRoom:
    """The tokens embeddings' chunks may take this step (embedding.py): what the step-time
    target leaves beside the decodes, as if every decode streamed already.

    NOTE: while no decode has settled, prompts take the whole fixed budget so a wave of them
    starts together (step_time.py, SETTLED_TOKENS); an embedding is no part of such a wave, and
    with its 512-token chunks beside the wave's first decodes the engine benchmark's row (g)
    had an ITL p99 up to 2.4x row (d)'s (1.2-1.8x with this room).
    Decided once per step, after the decodes; with no decodes, the embeddings take what is left;
    none on a step whose decodes run alone (the cadence's measure).
    NOTE: an embedding's floor is EMBED_FLOOR tokens, not a prompt's block: no stream waits on it
    for a first token, and where a token beside the decodes costs a lot (CPU, float32: about 6
    ms beside 6-7 decodes) a 16-token floor alone ran those steps to 2.3x a decode-only one.
    """

    def __init__(self, scheduler: Scheduler, step: ScheduledStep) -> None:
        self.scheduler, self.step = scheduler, step
        self.left: int | None = 0 if step.alone else None

    def take(self, seq: SequenceState, new: int, budget: int, spend: bool = False) -> int:
        """How many of `new` tokens embedding `seq` may compute; all of them for any other
        sequence. Spends them when `spend` (or when `seq` is already running)."""
        if seq.embedding is None:
            return new
        if self.left is None:
            decodes = self.step.decodes
            budget_ = self.scheduler.step_budget
            self.left = (
                budget
                if budget_ is None or not decodes
                else budget_.prefill_tokens(decodes, budget, 1, decodes, floor=EMBED_FLOOR)
            )
        new = min(new, self.left)
        if spend or seq.status == RequestStatus.RUNNING:
            self.left -= new
        return new
