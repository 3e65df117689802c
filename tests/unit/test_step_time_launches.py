"""The step-time target prices launches apart from tokens (workers/step_time.py): a decode-only
step replayed as one CUDA graph teaches the cadence, not the fit of the eager steps that launch
every kernel; and the engine says which steps replayed (a fake graph on the CPU)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from tests.support.worker_lines import wire
from tests.unit.test_decode_graphs import FakeGraph
from tests.unit.test_paged_engine import assert_no_leaks, submit, text_of
from tests.unit.test_step_time import FakeClock
from workers.decode_graphs import DecodeGraphs
from workers.engine import Engine
from workers.step_time import StepBudget

# A small model on a GPU: a decode-only step replayed as a graph takes 4 ms; an eager step
# launches every kernel itself, 30 ms before its tokens' 0.02 ms each.
REPLAY_S = 0.004
LAUNCHES_S = 0.030
PER_TOKEN_S = 0.00002
DECODES = 32
GREEDY = dict(temperature=0.0, ignore_eos=True)


class GraphDevice:
    """The fake clock moves by what a step costs on such a device; each step is reported to the
    budget as replayed when it was (`priced`), else as an eager step (the fit before launches
    were priced)."""

    def __init__(self, budget: StepBudget, clock: FakeClock, priced: bool) -> None:
        self.budget, self.clock, self.priced = budget, clock, priced

    def replay(self) -> None:
        self.budget.started()
        self.clock.now += REPLAY_S
        self.budget.ended(DECODES, DECODES, replayed=self.priced)

    def eager(self, prefill: int) -> None:
        self.budget.started()
        self.clock.now += LAUNCHES_S + PER_TOKEN_S * (DECODES + prefill)
        self.budget.ended(DECODES + prefill, DECODES)


def prefill_burst(priced: bool, prompt_tokens: int = 4096, limit: int = 512) -> list[int]:
    """32 settled decodes replay for 40 steps, then prompts of `prompt_tokens` in all arrive:
    the chunk each eager step takes until they are computed."""
    clock = FakeClock()
    budget = StepBudget(0.050, floor=16, clock=clock)
    device = GraphDevice(budget, clock, priced)
    for _ in range(40):
        device.replay()
    chunks: list[int] = []
    left = prompt_tokens
    while left and len(chunks) < 200:
        chunk = min(left, budget.prefill_tokens(DECODES, limit, prompts=8, settled=DECODES))
        device.eager(chunk)
        chunks.append(chunk)
        left -= chunk
    return chunks


def test_replayed_steps_set_the_cadence_and_leave_the_eager_fit():
    clock = FakeClock()
    budget = StepBudget(0.050, floor=16, clock=clock)
    device = GraphDevice(budget, clock, priced=True)
    for prefill in (100, 300, 100, 300):
        device.eager(prefill)
        device.replay()
    assert budget.cadence == pytest.approx(REPLAY_S, rel=0.01)
    assert budget.model.steps == 4  # the eager steps alone
    assert budget.model.per_token == pytest.approx(PER_TOKEN_S, rel=0.01)
    # the decodes run eagerly beside a chunk pay every launch: that is their price
    eager_decodes = LAUNCHES_S + PER_TOKEN_S * DECODES
    assert budget.model.predict(DECODES) == pytest.approx(eager_decodes, rel=0.01)


def test_a_prompt_burst_beside_replayed_decodes_goes_in_large_chunks():
    """Through one line, the jump from a replay to an eager step read as per-token cost: each
    chunk came out smaller than the last and the burst took 64 eager steps, each paying the
    launches for about a hundred tokens. Priced apart, the eager steps carry the fixed budget."""
    priced, unpriced = prefill_burst(priced=True), prefill_burst(priced=False)
    assert sum(priced) == sum(unpriced) == 4096
    assert len(priced) <= 10 and max(priced) == 512
    assert len(unpriced) >= 5 * len(priced)
    assert max(unpriced[2:]) < 512 / 2


def test_drafts_that_would_turn_a_replay_into_an_eager_step_get_no_room():
    """A decode-only step that would replay in 4 ms runs eagerly once drafts join it: the
    launches alone are past the cadence's bound, so the budget leaves no room for drafts."""
    clock = FakeClock()
    budget = StepBudget(0.050, floor=16, clock=clock)
    device = GraphDevice(budget, clock, priced=True)
    for prefill in (64, 256, 64, 256):
        device.eager(prefill)
        for _ in range(5):
            device.replay()
    assert budget.spare_tokens(DECODES, limit=64, decode_tokens=DECODES) == 0


def test_the_engine_reports_the_steps_a_graph_replayed(tiny, monkeypatch):
    """A fake capture on the CPU (the replay runs the slot's step): decode-only steps reach the
    budget as replayed, a step with a late prompt's prefill beside settled decodes as eager,
    and only the eager ones feed the fit; a step that captured a graph is not learned from."""
    model, tokenizer = tiny
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self, slot: FakeGraph(slot))
    engine = Engine(
        model,
        tokenizer,
        max_num_seqs=4,
        block_size=8,
        num_kv_blocks=64,
        speculative="off",
        static_decode=True,
        step_time_target_s=0.05,
    )
    graphs = engine.runner.graphs
    graphs.plan = dataclasses.replace(graphs.plan, capture=True)
    budget, steps = engine.scheduler.step_budget, []
    learn = budget.ended

    def ended(tokens, decodes, shaped=True, drafts=0, replayed=False) -> None:
        steps.append((tokens, decodes, replayed))
        learn(tokens, decodes, shaped, drafts, replayed)

    budget.ended = ended
    for i, text in enumerate(("one two", "three four five")):
        submit(engine, f"r{i}", tokenizer.encode(text) or [1], **GREEDY, max_tokens=24)
    events = defaultdict(list)
    while engine.has_unfinished():
        if len(steps) == 12:  # both decode, settled: a prompt comes in beside them
            submit(engine, "late", tokenizer.encode("six seven") or [1], **GREEDY, max_tokens=4)
        for out in engine.step():
            events[out.request_id].extend(wire(out.events))
    assert all(text_of(events[r]) for r in ("r0", "r1", "late"))
    replayed = [s for s in steps if s[2]]
    beside = [s for s in steps if not s[2] and 0 < s[1] < s[0]]  # prefill beside decodes
    assert replayed and all(tokens == decodes for tokens, decodes, _ in replayed)
    # a step that captured its graph (warm-ups, the capture) teaches the budget nothing
    assert graphs.graph_count >= 1
    assert len(replayed) == graphs.replays - graphs.graph_count
    assert beside and budget.model.steps == len(beside)
    assert budget.cadence is not None
    assert_no_leaks(engine)
