"""The step-time target: a fitted step cost, a prefill budget that shrinks when steps run long,
and prompts split into chunks so the running sequences keep their cadence (fake clock)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from tests.support.model_equivalence import stream_texts
from tests.support.worker_lines import wire
from tests.unit.test_paged_engine import assert_no_leaks, prompts, run, submit, text_of
from tests.unit.test_scheduler import make_seq
from workers.block_manager import BlockManager
from workers.embedding import Pool
from workers.engine import Engine
from workers.scheduler import ScheduledStep, Scheduler
from workers.step_time import (
    ITL_FLOOR_S,
    ITL_RATIO,
    MIN_PREFILL_SHARE,
    SETTLED_TOKENS,
    StepBudget,
    StepTimeModel,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TickingClock(FakeClock):
    """Each reading is a millisecond after the last: every real step looks quick, however busy
    the host, so what the budget allows does not depend on the machine."""

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


class FakeDevice:
    """A step costs `fixed + per_token x tokens` seconds of the fake clock."""

    def __init__(self, clock: FakeClock, fixed: float, per_token: float) -> None:
        self.clock, self.fixed, self.per_token = clock, fixed, per_token

    def seconds(self, step: ScheduledStep) -> float:
        return self.fixed + self.per_token * step.num_tokens

    def run(self, sched: Scheduler) -> tuple[list[tuple[str, int]], float]:
        """One engine step: schedule, run (the clock moves), read back; (work, seconds)."""
        step = sched.schedule()
        took = self.seconds(step)
        self.clock.now += took
        for seq, new in step.work:
            seq.num_computed_tokens += new
            if seq.num_computed_tokens == len(seq.all_ids) and seq.embedding is None:
                seq.append_token(7, None)
        sched.step_ended(step)
        return [(seq.request_id, new) for seq, new in step.work], took


def test_the_model_fits_a_fixed_cost_and_a_per_token_cost():
    model = StepTimeModel()
    assert model.predict(10) is None
    for tokens in (8, 72, 8, 136, 8, 40):
        model.observe(tokens, 0.010 + 0.001 * tokens)
    assert model.per_token == pytest.approx(0.001)
    assert model.predict(0) == pytest.approx(0.010)
    assert model.predict(200) == pytest.approx(0.210)


def test_same_sized_steps_give_the_cautious_mean_per_token():
    model = StepTimeModel()
    for _ in range(5):
        model.observe(20, 0.030)  # no spread in size: the fixed part cannot be told apart
    assert model.per_token == pytest.approx(0.0015)
    assert model.predict(20) == pytest.approx(0.030)


def test_noise_on_a_busy_machine_does_not_pass_for_per_token_cost():
    model = StepTimeModel()
    for tokens, seconds in ((17, 0.9), (31, 2.8), (17, 1.2), (25, 0.4), (18, 2.0), (24, 0.6)):
        model.observe(tokens, seconds)  # a long, noisy fixed part: the fit's slope is noise
    assert model.per_token == pytest.approx(0.4 / 25)  # the cheapest recent step bounds it


def measured_budget(untouched: Callable[[StepBudget], None]) -> StepBudget:
    """A 50 ms target whose fit has seen steps of 10 ms plus 1 ms a token; `untouched` checks
    the budget before anything was measured."""
    budget = StepBudget(0.050, floor=4, clock=FakeClock())
    untouched(budget)
    for tokens in (8, 40, 8, 40):
        budget.model.observe(tokens, 0.010 + 0.001 * tokens)
    return budget


def _prefill_is_the_fixed_budget(budget: StepBudget) -> None:
    assert budget.prefill_tokens(8, limit=512) == 512  # nothing measured yet: the fixed budget


def _spare_is_the_fixed_budget(budget: StepBudget) -> None:
    assert budget.spare_tokens(8, limit=100) == 100  # nothing measured yet: the fixed budget


def test_the_prefill_budget_shrinks_when_steps_run_long():
    budget = measured_budget(_prefill_is_the_fixed_budget)
    assert ITL_RATIO * 0.018 < 0.050  # eight decodes take 18 ms: the ITL ratio binds first
    assert budget.prefill_tokens(8, limit=512) == int((ITL_RATIO - 1) * 18)  # at 1 ms a token
    budget.target_s = 0.030  # a target below that: the target binds
    assert budget.prefill_tokens(8, limit=512) == pytest.approx(12, abs=1)  # (30 - 18) ms
    budget.target_s = 0.050
    allowed = []
    for _ in range(30):  # the machine gets twice as slow per token
        for tokens in (8, 40):
            budget.model.observe(tokens, 0.010 + 0.002 * tokens)
        allowed.append(budget.prefill_tokens(8, limit=512))
    # eight decodes now take 26 ms, so the ratio allows a longer step, but each prefill token
    # costs twice as much: fewer tokens: (min(50, 1.8 x 26) - 26) ms at 2 ms a token
    assert allowed[-1] == pytest.approx((min(50, ITL_RATIO * 26) - 26) / 2, abs=1)
    assert allowed[-1] < int((ITL_RATIO - 1) * 18)
    assert budget.prefill_tokens(8, limit=5) == 5  # never above the fixed budget
    assert budget.prefill_tokens(0, limit=512) == 512  # no decode waits: prefill takes it all


def test_a_step_with_prefill_stays_within_the_itl_ratio_of_a_decode_only_step_as_measured():
    """The fit, read at a few decodes, overstates a decode-only step when its line runs through
    dearer steps (chunks, drafts): the decode-only steps' own time (the cadence) bounds the step
    instead."""
    clock = FakeClock()
    budget = StepBudget(0.100, floor=4, clock=clock)
    for _ in range(10):
        budget.started()
        clock.now += 0.022
        budget.ended(4, decodes=4)  # four decodes alone: 22 ms
    budget.started()
    clock.now += 0.060
    budget.ended(24, decodes=4)  # a step with a chunk: not decode-only, the cadence keeps
    assert budget.cadence == pytest.approx(0.022)
    for _ in range(40):  # the fit's line: 20 ms + 1 ms a token, so four decodes "take" 24 ms
        budget.model.observe(8, 0.028)
        budget.model.observe(24, 0.044)
    assert budget.model.predict(4) == pytest.approx(0.024, abs=1e-4)
    # (1.8 x 22 - 24) ms of prefill at 1 ms a token
    assert budget.prefill_tokens(4, limit=512) == pytest.approx(ITL_RATIO * 22 - 24, abs=1)
    budget.cadence = None  # the fit alone would allow 1.8 x 24 ms
    assert budget.prefill_tokens(4, limit=512) == pytest.approx(ITL_RATIO * 24 - 24, abs=1)
    budget.cadence = 0.005  # a fast step: the floor (25 ms), not 1.8 x 5 ms, bounds the step;
    # beyond the fit's 24 ms for the decodes, prefill still gets its share (half of that)
    assert ITL_FLOOR_S > ITL_RATIO * 0.005
    assert budget.prefill_tokens(4, limit=512) == pytest.approx(MIN_PREFILL_SHARE * 24, abs=1)


def test_decodes_slower_than_the_target_still_leave_prefill_a_share():
    budget = StepBudget(0.050, floor=4, clock=FakeClock())
    for tokens in (64, 96, 64, 96):
        budget.model.observe(tokens, 0.001 * tokens)
    decodes_s = 0.064  # 64 decodes alone take longer than the target
    share = MIN_PREFILL_SHARE * decodes_s / 0.001
    assert budget.prefill_tokens(64, limit=512) == pytest.approx(share, abs=1)
    # fewer decodes: the share no longer rules; 2 decodes take 2 ms, and a step may take
    # 1.8 x that but never less than ITL_FLOOR_S (25 ms)
    assert budget.prefill_tokens(2, limit=512) == pytest.approx(1000 * ITL_FLOOR_S - 2, abs=1)
    assert budget.prefill_tokens(20, limit=512) == pytest.approx((ITL_RATIO - 1) * 20, abs=1)


def test_a_step_grows_only_as_far_as_the_fit_has_been_seen_to_hold():
    """Small chunks ride on the decodes' weight reads almost free, so a fit read off them prices
    a large chunk far too low: the step may grow to twice the largest measured, no further."""
    budget = StepBudget(0.050, floor=4)
    for _ in range(20):
        budget.model.observe(4, 0.100)  # four decodes
        budget.model.observe(24, 0.105)  # the same with a 20-token chunk: 0.25 ms a token
    assert budget.prefill_tokens(4, limit=512) == 2 * 24 - 4  # not 0.050 / 0.00025 = 200
    budget.model.observe(44, 0.110)
    assert budget.prefill_tokens(4, limit=512) == 2 * 44 - 4


def test_prompts_outnumbering_the_decodes_get_a_larger_share_up_to_the_itl_ratio():
    """A burst of prompts beside a few decodes: prefill's share of the decodes' time grows by
    prompts / decodes while prompts outnumber them, never past ITL_RATIO - 1 (a step with
    prefill stays within ITL_RATIO decode steps however long the queue), and falls back to the
    minimum after."""
    budget = StepBudget(0.020, floor=4)
    for _ in range(20):
        budget.model.observe(4, 0.040)  # four decodes alone outrun the target
        budget.model.observe(500, 0.536)  # 1 ms a token
    half = budget.prefill_tokens(4, limit=512, prompts=1)
    assert half == pytest.approx(MIN_PREFILL_SHARE * 40, abs=1)
    assert budget.prefill_tokens(4, limit=512, prompts=4) == half
    assert budget.prefill_tokens(4, limit=512, prompts=6) == pytest.approx(1.5 * half, abs=1)
    capped = (ITL_RATIO - 1) * 40
    assert budget.prefill_tokens(4, limit=512, prompts=16) == pytest.approx(capped, abs=1)
    assert budget.prefill_tokens(4, limit=512, prompts=64) == pytest.approx(capped, abs=1)


def test_decodes_that_have_not_settled_leave_prefill_the_fixed_budget():
    """The cadence kept is that of decodes already streaming: while every decode is younger
    than SETTLED_TOKENS, a wave's prompts take the fixed budget."""
    budget = StepBudget(0.050, floor=4, clock=FakeClock())
    for tokens in (64, 96, 64, 96):
        budget.model.observe(tokens, 0.001 * tokens)  # 64 decodes alone outrun the target
    assert budget.prefill_tokens(64, limit=512, prompts=8, settled=0) == 512
    share = budget.prefill_tokens(64, limit=512, prompts=8, settled=1)
    assert share == budget.prefill_tokens(64, limit=512, prompts=8) < 512


def test_a_wave_of_prompts_starts_together_as_with_the_fixed_budget():
    """Six prompts at once: the step-time target schedules them as the fixed budget does (a
    wave let in a chunk at a time starts, and so ends, staggered); once its decodes have
    settled, a new prompt is split again."""
    clock = FakeClock()
    device = FakeDevice(clock, fixed=0.005, per_token=0.0005)
    schedules = []
    for target_s in (0.020, None):
        budget = None if target_s is None else StepBudget(target_s, floor=4, clock=clock)
        sched = Scheduler(BlockManager(512, 4), 8, max_num_batched_tokens=512, step_budget=budget)
        for seq in decoding(sched, device, 1):  # the fit has seen its steps; it ends
            sched.release(seq)
        for i in range(6):
            sched.add(make_seq(f"w{i}", 150))
        learned = budget.model.steps if budget else 0
        schedules.append([device.run(sched)[0] for _ in range(4)])
        if budget is not None:  # only the last two (decodes alone) taught the fit
            assert budget.model.steps == learned + 2
        assert all(seq.num_uncomputed == 1 for seq in sched.running)  # all six decode
    timed, fixed = schedules
    assert timed == fixed and sum(n for work in fixed for _, n in work if n > 1) == 900


def test_a_step_whose_prefill_the_target_did_not_shape_teaches_the_fit_nothing():
    clock = FakeClock()
    budget = StepBudget(0.050, floor=4, clock=clock)
    for shaped, learned in ((False, 0), (True, 1)):
        budget.started()
        clock.now += 0.400
        budget.ended(512, decodes=8, shaped=shaped)  # a wave's whole-budget step
        assert budget.model.steps == learned


def test_optional_tokens_get_only_the_time_left_under_the_target():
    budget = measured_budget(_spare_is_the_fixed_budget)
    assert budget.spare_tokens(8, limit=100) == 32  # (50 - 18) ms at 1 ms a token
    assert budget.spare_tokens(8, limit=10) == 10
    assert budget.spare_tokens(40, limit=100) == 0  # at the target: no floor, no share past it
    assert budget.spare_tokens(64, limit=100) == 0
    # eight of the step's tokens decodes (18 ms alone): within 1.8 x 18 ms, not 50
    assert budget.spare_tokens(8, limit=100, decode_tokens=8) == int((ITL_RATIO - 1) * 18)
    assert budget.spare_tokens(20, limit=100, decode_tokens=8) == 2  # 30 ms of 32.4


def test_speculative_drafts_fit_under_the_target_with_the_prefill():
    clock = FakeClock()
    device = FakeDevice(clock, fixed=0.005, per_token=0.0005)
    sched = make_scheduler(clock, target_s=0.020)
    decoding(sched, device, 4)
    step = sched.schedule()  # four decodes: 7 ms, so 26 tokens more fit in 20 ms (1.8 x 7 ms
    # is under ITL_FLOOR_S: the target binds)
    assert step.num_tokens == 4 and sched.spare_tokens(step) == pytest.approx(26, abs=1)
    sched = make_scheduler(clock, target_s=0.020)  # the same decodes and a long prompt
    decoding(sched, device, 4)
    sched.add(make_seq("long", 300))
    step = sched.schedule()  # prefill takes its chunk, the drafts at most what time is left
    spare = sched.spare_tokens(step)
    assert 4 < step.num_tokens < 300 and spare < 26
    assert device.fixed + device.per_token * (step.num_tokens + spare) <= 0.020 * 1.05
    fixed = make_scheduler(clock, target_s=None)
    decoding(fixed, device, 2)
    step = fixed.schedule()
    assert fixed.spare_tokens(step) == 512 - 2  # no target: what the fixed budget leaves


def test_the_budget_times_a_step_between_schedule_and_read_back():
    clock = FakeClock()
    budget = StepBudget(0.050, floor=4, clock=clock)
    budget.ended(10, decodes=2)  # nothing started: nothing learned
    assert budget.model.steps == 0
    budget.started()
    clock.now += 0.020
    budget.ended(10, decodes=2)
    assert budget.model.predict(10) == pytest.approx(0.020)


def make_scheduler(clock: FakeClock, target_s: float | None) -> Scheduler:
    budget = None if target_s is None else StepBudget(target_s, floor=4, clock=clock)
    return Scheduler(
        BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=512, step_budget=budget
    )


def decoding(sched: Scheduler, device: FakeDevice, count: int) -> list:
    """`count` sequences past their prefill, streaming long enough to have settled
    (SETTLED_TOKENS); the step-time fit has seen their steps and one with a chunk."""
    seqs = [make_seq(f"d{i}", 6 + 10 * i) for i in range(count)]
    for seq in seqs:
        sched.add(seq)
        device.run(sched)
    for _ in range(SETTLED_TOKENS):
        device.run(sched)
    if sched.step_budget is not None:  # and a step with a chunk beside them: a slope to read
        tokens = count + 32
        sched.step_budget.model.observe(tokens, device.fixed + device.per_token * tokens)
    return seqs


def test_a_long_prompt_is_split_so_decodes_keep_their_cadence():
    clock = FakeClock()
    device = FakeDevice(clock, fixed=0.005, per_token=0.0005)
    sched = make_scheduler(clock, target_s=0.020)
    decoding(sched, device, 4)
    sched.add(make_seq("long", 300))
    steps = [device.run(sched) for _ in range(40)]
    chunks = [n for work, _ in steps for r, n in work if r == "long"]
    prefill = [n for n in chunks if n > 1]
    assert sum(prefill) == 300 and len(prefill) >= 5  # split into many chunks
    for work, took in steps:
        assert [r for r, _ in work[:4]] == ["d0", "d1", "d2", "d3"]  # every decode, first
        assert took <= 0.020 * 1.05  # no step ran much past the target


class LongGemmDevice(FakeDevice):
    """As FakeDevice, but a step without decodes costs `prompt_only` a token: one long GEMM is
    cheaper a token than a chunk riding with decodes."""

    def __init__(self, clock: FakeClock, fixed: float, per_token: float, prompt_only: float):
        super().__init__(clock, fixed, per_token)
        self.prompt_only = prompt_only

    def run(self, sched: Scheduler) -> tuple[list[tuple[str, int]], float]:
        if any(seq.num_uncomputed == 1 for seq in sched.running):
            return super().run(sched)
        per_token, self.per_token = self.per_token, self.prompt_only
        try:
            return super().run(sched)
        finally:
            self.per_token = per_token


def test_prompt_only_steps_do_not_teach_the_cost_of_a_chunk_beside_decodes():
    """Decodes outrun the target (100 ms against 50), so a step with a chunk may take about 1.5x
    a decode-only step; prompt-only steps, cheaper a token, must not talk the budget into more."""
    clock = FakeClock()
    device = LongGemmDevice(clock, fixed=0.100, per_token=0.003, prompt_only=0.0015)
    sched = make_scheduler(clock, target_s=0.050)
    sched.add(make_seq("doc", 400))
    device.run(sched)  # prompt only: 700 ms for 400 tokens
    for _ in range(SETTLED_TOKENS):
        device.run(sched)  # "doc" decodes alone: 103 ms
    sched.add(make_seq("long", 300))
    steps = [device.run(sched) for _ in range(30)]
    with_chunk = [took for work, took in steps if any(n > 1 for _, n in work)]
    assert len(with_chunk) >= 5  # the prompt went in chunks
    assert max(with_chunk) <= 1.5 * 0.103 * 1.1


def test_a_fixed_budget_runs_the_whole_prompt_in_one_long_step():
    clock = FakeClock()
    device = FakeDevice(clock, fixed=0.005, per_token=0.0005)
    sched = make_scheduler(clock, target_s=None)
    decoding(sched, device, 4)
    sched.add(make_seq("long", 300))
    work, took = device.run(sched)
    assert work[-1] == ("long", 300)
    assert took > 0.020 * 7  # the step the decodes wait on


def test_a_forked_choice_decodes_before_an_older_prompt_still_being_prefilled():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    leader, prompt = make_seq("n2", 4, n=2), make_seq("long", 30)
    child = make_seq("n2", 4, n=2, index=1)
    sched.add(leader)
    sched.add(prompt)
    step = sched.schedule()
    assert [(s.request_id, n) for s, n in step.work] == [("n2", 4), ("long", 6)]
    sched.computed(step.work)
    leader.append_token(7, None)
    assert sched.fork(leader, child).running  # joins the running list after the long prompt
    child.append_token(7, None)
    step = sched.schedule()
    assert [(s, n) for s, n in step.work] == [(leader, 1), (child, 1), (prompt, 8)]


def test_an_engine_under_a_tight_target_splits_prompts_and_generates_the_same_text(tiny):
    model, tokenizer = tiny
    engines = [
        Engine(
            model,
            tokenizer,
            num_kv_blocks=96,
            block_size=8,
            max_num_batched_tokens=256,
            step_time_target_s=target,
        )
        for target in (None, 1e-9)  # fixed budget; a target no step can meet
    ]
    texts = []
    for engine in engines:
        first, *later = prompts(tokenizer, 6, seed=3)
        submit(engine, "r0", first, max_tokens=24, temperature=0.0, ignore_eos=True)
        events = defaultdict(list)
        for _ in range(SETTLED_TOKENS + 1):  # r0 streams: its cadence is the one kept
            for out in engine.step():
                events[out.request_id].extend(wire(out.events))
        for i, ids in enumerate(later, 1):
            submit(engine, f"r{i}", ids, max_tokens=24, temperature=0.0, ignore_eos=True)
        for rid, evs in run(engine).items():
            events[rid].extend(evs)
        texts.append({rid: text_of(evs) for rid, evs in events.items()})
        assert_no_leaks(engine)
    fixed, timed = engines
    assert texts[0] == texts[1] and all(texts[0].values())
    assert timed.stats().steps_total > fixed.stats().steps_total  # prompts went in smaller chunks


def test_the_worker_setting_reaches_the_engine_and_zero_turns_it_off():
    from workers.config import WorkerConfig

    assert WorkerConfig().engine_kwargs("cpu")["step_time_target_s"] == 0.05
    assert WorkerConfig(step_time_target_s=0).engine_kwargs("cpu")["step_time_target_s"] is None
    assert WorkerConfig(step_time_target_s=0.2).engine_kwargs("cpu")["step_time_target_s"] == 0.2


def test_cuda_runs_without_a_target_unless_one_is_set():
    """A CUDA step's time hardly moves with its tokens (the host launching kernels bounds it),
    so a target that prices tokens would only starve prefill there: off unless set."""
    from workers.config import WorkerConfig

    assert WorkerConfig().engine_kwargs("cuda")["step_time_target_s"] is None
    assert WorkerConfig(step_time_target_s=0.03).engine_kwargs("cuda")["step_time_target_s"] == 0.03


def test_draft_tokens_are_priced_at_what_they_took_not_at_a_prompts_rate():
    """Steps with prefill at 1 ms a token and steps with drafts at 2 ms a draft token, beside
    the same eight decodes: the fit's slope stays the prompts' (its bound is the cheapest recent
    step's), the drafts get a price of their own, and the spare tokens for drafts follow it."""
    clock = FakeClock()
    budget = StepBudget(0.050, floor=4, clock=clock)

    def step(tokens: int, seconds: float, drafts: int = 0) -> None:
        budget.started()
        clock.now += seconds
        budget.ended(tokens, 8, drafts=drafts)

    for _ in range(30):
        step(8, 0.018)  # the decodes alone
        step(24, 0.034)  # with a 16-token chunk
        step(16, 0.034, drafts=8)  # with 8 draft tokens
    slope, draft_cost = budget.model.per_token, budget.draft_cost
    assert slope == pytest.approx(0.001, rel=0.05)
    assert draft_cost > 1.5 * slope
    room = ITL_RATIO * budget.cadence - budget.model.predict(8)
    assert budget.spare_tokens(8, limit=100, decode_tokens=8) == int(room / draft_cost)
    assert int(room / draft_cost) < int(room / slope)


def test_a_step_without_drafts_leaves_their_price_unlearned():
    clock = FakeClock()
    budget = StepBudget(0.050, floor=4, clock=clock)
    for tokens in (8, 24, 8, 24):
        budget.started()
        clock.now += 0.010 + 0.001 * tokens
        budget.ended(tokens, 8)
    assert budget.draft_cost is None


def test_the_engine_tells_the_budget_how_many_draft_tokens_a_step_carried(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(
        model,
        tokenizer,
        max_num_seqs=2,
        num_kv_blocks=64,
        block_size=8,
        step_time_target_s=0.05,
        speculative="prompt-lookup",
    )
    budget, drafts = engine.scheduler.step_budget, []
    budget.clock = TickingClock()  # quick steps: drafts fit under the target on any host
    learn = budget.ended

    def ended(
        tokens: int, decodes: int, shaped: bool = True, drafted: int = 0, replayed: bool = False
    ) -> None:
        drafts.append(drafted)
        learn(tokens, decodes, shaped, drafted, replayed)

    budget.ended = ended
    ids = tokenizer.encode("ab ab ab ab ab ab ab ab") or [1]
    texts = stream_texts(engine, [ids, ids], [24, 24])
    assert all(texts.values()) and any(drafts)  # some steps verified drafts ...
    assert budget.draft_cost is not None  # ... and the budget priced them


def test_an_embedding_beside_a_young_wave_gets_only_the_shaped_room():
    """While no decode has settled a wave's prompts take the whole fixed budget; an input to
    embed beside them gets only what the target leaves (scheduler._EmbeddingRoom)."""
    chunks = {}
    for kind in ("prompt", "embedding"):
        clock = FakeClock()
        device = FakeDevice(clock, fixed=0.005, per_token=0.0005)
        sched = make_scheduler(clock, target_s=0.020)
        for seq in decoding(sched, device, 4):  # the fit has seen decode steps; they end
            sched.release(seq)
        for i in range(4):
            sched.add(make_seq(f"w{i}", 6))
        device.run(sched)
        device.run(sched)  # the wave decodes, young (fewer than SETTLED_TOKENS tokens)
        assert all(len(s.output_ids) < SETTLED_TOKENS for s in sched.running)
        long = make_seq("long", 400)
        if kind == "embedding":
            long.embedding = Pool("mean", None)
        sched.add(long)
        (chunks[kind],) = [n for seq, n in sched.schedule().work if seq is long]
    shaped = sched.step_budget.prefill_tokens(4, 512, 1, 4)
    assert chunks["prompt"] == 400 and chunks["embedding"] == shaped < 400
