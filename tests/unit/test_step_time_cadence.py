"""The cadence under a backlog: when every step would carry a chunk (embeddings queued all the
while), a step now and then runs its decodes alone so their own time is measured; an
embedding's chunk may be smaller than a prompt's floor (fake clock)."""

from __future__ import annotations

import itertools

import pytest

from tests.unit.test_fair_scheduling import make_seq as fair_seq
from tests.unit.test_fair_scheduling import run_step
from tests.unit.test_scheduler import make_seq
from tests.unit.test_step_time import FakeClock, FakeDevice, decoding
from workers.block_manager import BlockManager
from workers.embedding import Pool
from workers.scheduler import EMBED_FLOOR, ScheduledStep, Scheduler
from workers.step_time import CADENCE_EVERY, ITL_RATIO, SETTLED_TOKENS, StepBudget


class DearDecodesDevice(FakeDevice):
    """A decode costs more than a chunk's token (its own attention over a long past, its own
    logits row): a line fitted through steps that all carry a chunk overstates the decodes
    alone, as on a CPU in float32."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, fixed=0.004, per_token=0.001)
        self.per_decode = 0.006

    def seconds(self, step: ScheduledStep) -> float:
        chunks = step.num_tokens - step.decodes
        return self.fixed + self.per_decode * step.decodes + self.per_token * chunks


def make_scheduler(clock: FakeClock, floor: int) -> Scheduler:
    budget = StepBudget(0.020, floor=floor, clock=clock)
    return Scheduler(BlockManager(512, 4), 8, max_num_batched_tokens=512, step_budget=budget)


def test_the_cadence_is_due_once_every_cadence_every_steps_without_a_decode_only_one():
    clock = FakeClock()
    budget = StepBudget(0.050, floor=4, clock=clock)

    def step(tokens: int, decodes: int) -> None:
        budget.started()
        clock.now += 0.001 * tokens
        budget.ended(tokens, decodes)

    assert budget.cadence_due()  # never measured: the first step with decodes may measure it
    assert not budget.cadence_due()  # asked once, it is not due again at once
    for _ in range(CADENCE_EVERY - 1):
        step(20, decodes=4)  # every step carries a chunk
        assert not budget.cadence_due()
    step(20, decodes=4)
    assert budget.cadence_due()
    step(4, decodes=4)  # a decode-only step: the cadence is measured, the count starts over
    assert budget.cadence == pytest.approx(0.004)
    for _ in range(CADENCE_EVERY - 1):
        step(20, decodes=4)
    assert not budget.cadence_due()
    step(20, decodes=0)  # a step without decodes counts for nothing
    assert not budget.cadence_due()
    for _ in range(CADENCE_EVERY):  # nor do steps whose only extra tokens are drafts
        budget.started()
        clock.now += 0.010
        budget.ended(10, decodes=4, drafts=6)
    assert not budget.cadence_due()
    step(20, decodes=4)
    assert budget.cadence_due()


def test_a_step_whose_decodes_run_alone_takes_no_drafts():
    """Drafts would make it other than decode-only, and its time no measure of the cadence."""
    clock = FakeClock()
    device = DearDecodesDevice(clock)
    sched = make_scheduler(clock, floor=4)
    decoding(sched, device, 4)
    sched.step_budget.target_s = 1.0  # room for drafts in any step
    sched.add(make_seq("long", 400))
    sched.step_budget._unmeasured = CADENCE_EVERY  # as after a backlog of chunked steps
    step = sched.schedule()
    assert step.alone and step.num_tokens == step.decodes == 4  # the prompt waits a step
    assert sched.spare_tokens(step) == 0
    step.alone = False  # the same step, not measuring the cadence, would take drafts
    assert sched.spare_tokens(step) > 0


def test_a_backlog_of_embeddings_leaves_a_decode_only_step_now_and_then():
    """The documents queue from the start, so without these steps the fit would see only steps
    that carry a chunk and the cadence would never be measured."""
    clock = FakeClock()
    device = DearDecodesDevice(clock)
    sched = make_scheduler(clock, floor=4)
    decoding(sched, device, 4)
    sched.step_budget = budget = StepBudget(0.020, floor=4, clock=clock)  # nothing measured yet
    documents = []
    for i in range(4):
        doc = make_seq(f"doc{i}", 400)
        doc.embedding = Pool("mean", None)
        sched.add(doc)
        documents.append(doc)
    steps = [device.run(sched) for _ in range(4 * CADENCE_EVERY)]
    assert documents[-1].num_computed_tokens < 400  # a backlog throughout
    alone = [i for i, (work, _) in enumerate(steps) if all(n == 1 for _, n in work)]
    assert alone[0] == 0 and len(alone) >= 3  # decodes alone every CADENCE_EVERY + 1 steps ...
    assert all(b - a == CADENCE_EVERY + 1 for a, b in itertools.pairwise(alone))
    assert len(alone) <= 1 + len(steps) // CADENCE_EVERY  # ... and only then
    decodes_alone = device.fixed + 4 * device.per_decode
    assert budget.cadence == pytest.approx(decodes_alone)
    # the fit prices the decodes alone near what they take, and steps with
    # a chunk stay within the step budget once it has learned
    assert budget.model.predict(4) == pytest.approx(decodes_alone, rel=0.1)
    learned = steps[alone[1] :]
    assert max(took for _, took in learned) <= ITL_RATIO * decodes_alone


def test_an_embedding_may_take_a_chunk_below_a_prompts_floor():
    """Where the share left beside the decodes is below a block, a prompt still moves a block
    (its client waits for a first token), an embedding only what the share allows."""
    chunks = {}
    for kind in ("prompt", "embedding"):
        clock = FakeClock()
        device = DearDecodesDevice(clock)
        sched = make_scheduler(clock, floor=16)
        decoding(sched, device, 4)
        for _ in range(CADENCE_EVERY):  # the cadence measured, none due for a while
            device.run(sched)
        assert not sched.step_budget.cadence_due()
        sched.step_budget.target_s = 0.001  # decodes alone past the target: the share is left
        long = make_seq("long", 400)
        if kind == "embedding":
            long.embedding = Pool("mean", None)
        sched.add(long)
        (chunks[kind],) = [n for seq, n in sched.schedule().work if seq is long]
    share = sched.step_budget.prefill_tokens(4, 512, 1, 4, floor=0)
    assert 0 < share < 16
    assert chunks["prompt"] == 16
    assert chunks["embedding"] == max(EMBED_FLOOR, share) < 16


def test_a_sequence_that_yields_its_place_lets_the_waiting_one_start_at_once():
    """The decodes do not run alone on a step where one of them yielded to a waiting sequence
    (fair sharing): that one starts in the same step, and the cadence is measured on the next."""
    clock = FakeClock()
    budget = StepBudget(0.050, floor=4, clock=clock)
    sched = Scheduler(BlockManager(64, 4), 4, 256, step_budget=budget, fair=True)
    for i in range(4):
        sched.add(fair_seq(f"n{i}", "noisy"))
    for _ in range(SETTLED_TOKENS + 1):  # the batch is full, its decodes settled
        run_step(sched)
    sched.add(fair_seq("q", "quiet"))
    budget._unmeasured = CADENCE_EVERY  # the cadence is due
    step = sched.schedule()
    assert [s.request_id for s in step.yielded] == ["n3"]
    assert not step.alone and ("q", 4) in [(s.request_id, n) for s, n in step.work]
    sched.computed(step.work)
    for seq, _ in step.work:
        if seq.num_computed_tokens == len(seq.all_ids):
            seq.append_token(7, None)
    sched.step_ended(step)
    following = sched.schedule()
    assert following.alone and following.num_tokens == following.decodes == 4
