"""Fair scheduling in the engine (design §12, workers/fair_policy.py): the waiting order by tier
and tenant, who yields to whom and why, the once-per-sequence bound, and arrival order under
`fcfs`. Exact orderings, exact victims, exact counts."""

from __future__ import annotations

from wire.sampling_params import SamplingParams
from wire.share import Share
from workers.block_manager import BlockManager
from workers.request import RequestStatus, SequenceState
from workers.scheduler import Scheduler


def make_seq(
    request_id: str, tenant: str, *, prompt_len: int = 4, weight: float = 1.0, tier="default"
) -> SequenceState:
    return SequenceState(
        request_id=request_id,
        index=0,
        params=SamplingParams(),
        prompt_ids=[hash((request_id, i)) % 1000 for i in range(prompt_len)],
        max_tokens=100,
        detokenizer=None,
        holdback=None,
        generator=None,
        share=Share(tenant, weight, tier),
    )


def make_scheduler(seqs: int = 4, blocks: int = 64, fair: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(blocks, 4), max_num_seqs=seqs, max_num_batched_tokens=256, fair=fair
    )


def run_step(sched: Scheduler) -> list[str]:
    """Schedule, pretend the model ran (computed tokens advance, samplers get a token); the
    ids of the sequences given work, in schedule order."""
    step = sched.schedule()
    sched.computed(step.work)
    for seq, _ in step.work:
        if seq.num_computed_tokens == len(seq.all_ids):
            seq.append_token(7, None)
    return [seq.request_id for seq, _ in step.work]


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_waiting_goes_by_tier_then_by_the_tenants_virtual_time_then_arrival():
    sched = make_scheduler(seqs=1)
    busy = make_seq("busy-0", "busy")
    sched.add(busy)
    run_step(sched)  # busy runs alone: 4 prompt tokens served
    run_step(sched)  # and one decode: 5 tokens, virtual time 5
    waiting = [
        make_seq("busy-1", "busy"),
        make_seq("flex-1", "idle", tier="flex"),
        make_seq("idle-1", "idle"),
        make_seq("idle-2", "idle"),
        make_seq("vip-1", "busy", tier="priority"),
    ]
    for seq in waiting:
        sched.add(seq)
    # idle entered at busy's virtual time (5, no credit banked) but runs nothing: it goes
    # ahead of busy's second request, its own two in arrival order; flex last, priority first
    assert sched.policy.vtime("idle") == sched.policy.vtime("busy") == 5
    order = sched.policy.order(sched.waiting, sched.running)
    assert ids(order) == ["vip-1", "idle-1", "idle-2", "busy-1", "flex-1"]


def test_virtual_time_is_tokens_served_divided_by_weight():
    sched = make_scheduler(seqs=2)
    heavy, light = make_seq("h", "heavy", weight=4.0), make_seq("l", "light", weight=1.0)
    sched.add(heavy)
    sched.add(light)
    assert run_step(sched) == ["h", "l"]  # 4 prompt tokens each
    run_step(sched)  # one decode each
    assert sched.policy.vtime("heavy") == 5 / 4
    assert sched.policy.vtime("light") == 5


def test_a_tenant_that_leaves_banks_nothing_and_owes_nothing():
    sched = make_scheduler(seqs=2)
    a, b = make_seq("a", "A"), make_seq("b", "B")
    sched.add(a)
    run_step(sched)
    run_step(sched)  # A: 5 tokens
    sched.add(b)  # B enters at A's virtual time
    assert sched.policy.vtime("B") == 5
    sched.release(b)
    run_step(sched)  # A: 6
    sched.add(make_seq("b2", "B"))  # B comes back at the least active time, not its old one
    assert sched.policy.vtime("B") == 6


def test_a_tenant_under_its_share_takes_the_newest_slot_of_the_one_over_it_at_once():
    sched = make_scheduler(seqs=4)
    noisy = [make_seq(f"n{i}", "noisy") for i in range(5)]
    for seq in noisy:
        sched.add(seq)
    assert run_step(sched) == ["n0", "n1", "n2", "n3"]  # the batch is full; n4 waits
    quiet = make_seq("q", "quiet")
    sched.add(quiet)
    step = sched.schedule()
    # quiet's share is 2 of 4 slots, noisy's 2 and it runs 4: its newest yields, and quiet
    # starts in this very step (ahead of n4, which arrived first)
    assert ids(step.yielded) == ["n3"]
    assert [(s.request_id, n) for s, n in step.work] == [("n0", 1), ("n1", 1), ("n2", 1), ("q", 4)]
    assert noisy[3].status == RequestStatus.WAITING and noisy[3].block_table == []
    assert noisy[3].yields == 1
    assert sched.preempted_by == {"fairness": 1}
    assert ids(sched.waiting) == ["n3", "n4"]


def test_a_higher_tier_takes_the_newest_slot_of_the_lowest_tier_running():
    sched = make_scheduler(seqs=3)
    for seq in (
        make_seq("d0", "A"),
        make_seq("f0", "A", tier="flex"),
        make_seq("d1", "B"),
    ):
        sched.add(seq)
    assert run_step(sched) == ["d0", "d1", "f0"]  # flex starts last
    sched.add(make_seq("p", "A", tier="priority"))
    step = sched.schedule()
    assert ids(step.yielded) == ["f0"]  # the lowest tier first
    assert ids(s for s, _ in step.work)[-1] == "p"
    sched.add(make_seq("p2", "B", tier="priority"))
    step = sched.schedule()
    assert ids(step.yielded) == ["d1"]  # no flex left: the newest default
    assert sched.preempted_by == {"priority": 2}


def test_flex_never_takes_a_slot_from_default():
    sched = make_scheduler(seqs=2)
    for seq in (make_seq("d0", "A"), make_seq("d1", "A")):
        sched.add(seq)
    run_step(sched)
    sched.add(make_seq("f", "B", tier="flex"))
    for _ in range(3):
        assert "f" not in run_step(sched)
    assert sched.preemptions == 0


def test_a_sequence_yields_at_most_once():
    sched = make_scheduler(seqs=2)
    for seq in (make_seq("n0", "noisy"), make_seq("n1", "noisy")):
        sched.add(seq)
    run_step(sched)
    sched.add(make_seq("q0", "quiet"))
    assert ids(sched.schedule().yielded) == ["n1"]
    sched.release(sched.running[-1])  # quiet's request ends; n1 runs again
    assert run_step(sched) == ["n0", "n1"]
    sched.add(make_seq("q1", "quiet"))
    # n1 yielded once already: n0 yields this time; then neither may
    assert ids(sched.schedule().yielded) == ["n0"]
    sched.release(sched.running[-1])
    run_step(sched)
    sched.add(make_seq("q2", "quiet"))
    step = sched.schedule()
    assert step.yielded == [] and ids(sched.waiting) == ["q2"]
    assert sched.preempted_by == {"fairness": 2}


def test_weighted_shares_settle_without_trading_slots_back_and_forth():
    sched = make_scheduler(seqs=4)
    light = [make_seq(f"l{i}", "light", weight=1.0) for i in range(4)]
    heavy = [make_seq(f"h{i}", "heavy", weight=3.0) for i in range(4)]
    for seq in light[:2]:
        sched.add(seq)
    run_step(sched)
    for seq in (*light[2:], *heavy):
        sched.add(seq)
    run_step(sched)  # the two free slots go to heavy, whose virtual time is the lower
    running = [s.share.tenant for s in sched.running]
    assert running.count("heavy") == 2 and running.count("light") == 2
    yielded = []
    for _ in range(6):
        step = sched.schedule()
        sched.computed(step.work)
        yielded += ids(step.yielded)
    # heavy's share is 3 of 4: one light sequence yields, then the 3:1 split holds still
    assert yielded == ["l1"]
    running = [s.share.tenant for s in sched.running]
    assert running.count("heavy") == 3 and running.count("light") == 1


def test_one_tenant_alone_uses_every_slot():
    sched = make_scheduler(seqs=3)
    for i in range(5):
        sched.add(make_seq(f"a{i}", "A"))
    assert run_step(sched) == ["a0", "a1", "a2"]
    assert run_step(sched) == ["a0", "a1", "a2"]
    assert sched.preemptions == 0


def test_blocks_run_short_the_over_served_tenants_newest_gives_them_back():
    # 6 blocks of 4 tokens; three sequences of 7 tokens take 2 blocks each
    sched = make_scheduler(seqs=4, blocks=6)
    a0, a1, b0 = (make_seq(r, t, prompt_len=7) for r, t in (("a0", "A"), ("a1", "A"), ("b0", "B")))
    for seq in (a0, a1, b0):  # b0 is the newest
        sched.add(seq)
    run_step(sched)  # 7 prompt tokens computed, 1 output each: two blocks each, the pool full
    run_step(sched)  # the 8th token still fits in the second block
    step = sched.schedule()  # each needs a third block: A runs two, so a1 yields its blocks
    assert ids(step.preempted) == ["a1"]
    assert sched.preempted_by == {"kv": 1}
    assert a1.yields == 0  # forced: not counted against the bound


def test_fcfs_keeps_arrival_order_and_never_yields():
    sched = make_scheduler(seqs=2, fair=False)
    for seq in (make_seq("n0", "noisy"), make_seq("n1", "noisy"), make_seq("n2", "noisy")):
        sched.add(seq)
    run_step(sched)
    sched.add(make_seq("vip", "quiet", tier="priority"))
    assert sched.schedule().yielded == []
    assert ids(sched.waiting) == ["n2", "vip"]
    sched.release(sched.running[0])
    assert run_step(sched)[-1] == "n2"


def test_the_tenant_short_of_its_share_starts_next_whatever_it_spent_before():
    sched = make_scheduler(seqs=2)
    sched.add(make_seq("a0", "A", prompt_len=40))
    sched.add(make_seq("b0", "B", prompt_len=4))
    assert run_step(sched) == ["a0", "b0"]  # A has spent 40 tokens, B 4
    sched.add(make_seq("a1", "A"))
    sched.add(make_seq("b1", "B"))
    sched.release(sched.running[0])  # a0 ends: A runs nothing, B runs its share (1 of 2)
    assert sched.policy.vtime("A") > sched.policy.vtime("B")
    assert ids(sched.policy.order(sched.waiting, sched.running)) == ["a1", "b1"]
