"""Scheduler: token budget, chunked prefill, admission by free blocks, preemption by recompute."""

from __future__ import annotations

from wire.sampling_params import SamplingParams
from workers.block_manager import BlockManager
from workers.request import RequestStatus, SequenceState
from workers.scheduler import Scheduler


def make_seq(request_id: str, prompt_len: int, n: int = 1, index: int = 0) -> SequenceState:
    return SequenceState(
        request_id=request_id,
        index=index,
        params=SamplingParams(n=n),
        prompt_ids=[hash((request_id, i)) % 1000 for i in range(prompt_len)],
        max_tokens=100,
        detokenizer=None,
        holdback=None,
        generator=None,
    )


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the model ran: computed tokens advance, samplers get a token."""
    step = sched.schedule()
    for seq, new in step.work:
        seq.num_computed_tokens += new
        if seq.num_computed_tokens == len(seq.all_ids):
            seq.append_token(7, None)
    return [(seq.request_id, new) for seq, new in step.work]


def test_long_prompt_is_prefilled_in_chunks_while_decodes_keep_flowing():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    short, long = make_seq("short", 3), make_seq("long", 20)
    sched.add(short)
    assert run_step(sched) == [("short", 3)]
    sched.add(long)
    assert run_step(sched) == [("short", 1), ("long", 7)]
    assert run_step(sched) == [("short", 1), ("long", 7)]
    assert run_step(sched) == [("short", 1), ("long", 6)]
    assert run_step(sched) == [("short", 1), ("long", 1)]
    assert long.output_ids == [7, 7]


def test_admission_waits_for_free_blocks_and_max_num_seqs():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = make_seq("a", 8), make_seq("b", 8), make_seq("c", 2)
    for seq in (a, b, c):
        sched.add(seq)
    assert run_step(sched) == [("a", 8), ("b", 8)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert list(sched.waiting) == [c]  # max_num_seqs and no free block
    sched.release(a)
    assert run_step(sched) == [("b", 1), ("c", 2)]
    assert c.block_table == [0]  # a's blocks came back


def test_out_of_blocks_preempts_the_newest_running_sequence():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    old, new = make_seq("old", 7), make_seq("new", 7)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled: 2 blocks each, pool full; each sampled one token
    assert (old.block_table, new.block_table) == ([0, 1], [2, 3])
    assert run_step(sched) == [("old", 1), ("new", 1)]  # token 8 still fits in block 2 of each
    step = sched.schedule()  # token 9 needs a third block: the newest yields its blocks
    assert [s.request_id for s in step.preempted] == ["new"]
    assert [(s.request_id, n) for s, n in step.work] == [("old", 1)]
    assert old.block_table == [0, 1, 3]
    assert new.status == RequestStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and list(sched.waiting) == [new]
    assert sched.preemptions == 1


def test_a_preempted_sequence_recomputes_prompt_and_output_from_the_cache():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=100)
    seq = make_seq("s", 9)
    sched.add(seq)
    run_step(sched)
    run_step(sched)  # 9 prompt + 2 output tokens, 10 computed
    blocks.register_computed(seq)
    sched._preempt(seq, "kv")
    assert run_step(sched) == [("s", 3)]  # 8 tokens come back from the prefix cache
    assert blocks.prefix_hits == 8


def test_a_prompt_with_n_choices_reserves_a_slot_per_choice():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=3, max_num_batched_tokens=100)
    x, y = make_seq("x", 4, n=3), make_seq("y", 4)
    sched.add(x)
    sched.add(y)
    assert run_step(sched) == [("x", 4)]
    assert list(sched.waiting) == [y]


def test_finish_is_idempotent_and_frees_everything():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=100)
    seq = make_seq("s", 6)
    sched.add(seq)
    run_step(sched)
    sched.release(seq)
    sched.release(seq)
    assert blocks.num_used == 0 and not sched.running and not sched.waiting
