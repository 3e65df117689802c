"""Prompt lookup, the acceptance rule and the speculator's budget, without a model."""

from __future__ import annotations

import pytest

from wire.sampling_params import SamplingParams
from workers.block_manager import BlockManager
from workers.request import SequenceState
from workers.scheduler import Scheduler
from workers.speculative import (
    MAX_SPECULATING_DECODES,
    NgramIndex,
    Speculator,
    accepted_tokens,
    can_speculate,
)


def make_seq(tokens: list[int], output: int = 1, **params) -> SequenceState:
    """A sequence whose last `output` tokens are output, the rest prompt, decoding (one token
    left to compute)."""
    prompt, out = tokens[: len(tokens) - output], tokens[len(tokens) - output :]
    seq = SequenceState(
        request_id="r",
        index=0,
        params=SamplingParams(**{"temperature": 0.0, **params}),
        prompt_ids=prompt,
        max_tokens=100,
        detokenizer=None,
        holdback=None,
        generator=None,
    )
    for token in out:
        seq.append_token(token, None)
    seq.num_computed_tokens = len(seq.all_ids) - 1
    return seq


def test_lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram():
    index = NgramIndex()
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 1, 2, 3]
    # the 3-gram (1, 2, 3) ended at 3; the later (2, 3) at 8 is only a 2-gram match
    assert index.propose(tokens, 4) == [9, 9, 7, 2]
    assert NgramIndex().propose(tokens, 2) == [9, 9]


def test_lookup_falls_back_to_shorter_ngrams_then_to_nothing():
    assert NgramIndex().propose([4, 2, 8, 6, 2], 3) == [8, 6, 2]  # only the 1-gram (2,)
    assert NgramIndex().propose([1, 2, 3, 4], 3) == []
    assert NgramIndex().propose([7], 3) == []
    assert NgramIndex().propose([1, 2, 1, 2], 0) == []


def test_the_index_grows_with_the_tokens_and_finds_the_newest_occurrence():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 1, 2]
    assert index.propose(tokens, 3) == [3, 4, 1]
    tokens += [8, 1, 2]  # (1, 2) now also ended at 5, followed by 8
    assert index.propose(tokens, 3) == [8, 1, 2]
    assert index.propose(tokens, 3) == NgramIndex().propose(tokens, 3)


@pytest.mark.parametrize(
    ("draft", "targets", "emitted"),
    [
        ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]),  # all agreed: plus the bonus token
        ([4, 5, 6], [4, 9, 6, 7], [4, 9]),  # first mismatch: the model's own token there
        ([4, 5, 6], [8, 5, 6, 7], [8]),  # nothing agreed: one token, as without a draft
        ([4], [4, 3], [4, 3]),
    ],
)
def test_acceptance_takes_the_agreeing_prefix_and_the_models_next_token(draft, targets, emitted):
    assert accepted_tokens(draft, targets) == emitted


def test_only_plain_greedy_decodes_speculate():
    assert can_speculate(make_seq([1, 2, 3]))
    assert not can_speculate(make_seq([1, 2, 3], temperature=0.7, seed=1))
    assert not can_speculate(make_seq([1, 2, 3], presence_penalty=0.5))
    assert not can_speculate(make_seq([1, 2, 3], output=0))  # the first token: n forks there
    constrained = make_seq([1, 2, 3])
    constrained.grammar = object()  # a matcher advances token by token
    assert not can_speculate(constrained)
    prefilling = make_seq([1, 2, 3])
    prefilling.num_computed_tokens = 1
    assert not can_speculate(prefilling)


def scheduled(seqs: list[SequenceState], blocks: int = 16) -> tuple[Scheduler, list]:
    sched = Scheduler(BlockManager(blocks, 4), max_num_seqs=8, max_num_batched_tokens=64)
    for seq in seqs:  # running, as after its prefill
        sched.blocks.allocate(seq)
        sched.running.append(seq)
        seq.num_computed_tokens = len(seq.all_ids) - 1
    return sched, [(seq, 1) for seq in seqs]


def test_drafts_take_only_the_spare_budget_and_the_room_max_tokens_leaves():
    a, b, c = (make_seq([1, 2, 3, 4, 5, 6, 1, 2]) for _ in range(3))
    c.max_tokens = 4  # two output tokens left: a draft of one plus the model's own
    c.append_token(3, None)
    c.num_computed_tokens += 1
    sched, work = scheduled([a, b, c])
    spec = Speculator("prompt-lookup", 4)
    spec.extend(work, sched, spare=6)
    assert [(s.draft, n) for s, n in work] == [([3, 4, 5, 6], 5), ([3, 4], 3), ([], 1)]
    assert a.all_ids[-5:] == [2, 3, 4, 5, 6] and len(c.all_ids) == 9
    spec.extend(work2 := [(c, 1)], sched, spare=6)
    assert work2 == [(c, 2)] and c.draft == [4]


def test_a_draft_never_preempts_for_blocks():
    seq = make_seq([1, 2, 3, 1, 2])  # 5 tokens in 2 blocks of 4
    sched, work = scheduled([seq], blocks=2)
    Speculator("prompt-lookup", 4).extend(work, sched, spare=10)
    assert work == [(seq, 4)] and seq.draft == [3, 1, 2]  # fits the second block: drafted
    seq2 = make_seq([1, 2, 3, 4, 1, 2, 3, 4])  # 8 tokens: its 2 blocks full
    sched, work = scheduled([seq2], blocks=2)
    Speculator("prompt-lookup", 4).extend(work, sched, spare=10)
    assert work == [(seq2, 1)] and not seq2.draft and seq2.all_ids[-1] == 4
    assert sched.blocks.num_free == 0 and sched.running == [seq2]


def test_settle_commits_the_accepted_tokens_only_and_discard_drops_a_draft():
    seq = make_seq([1, 2, 3, 4, 5, 6, 1, 2])
    sched, work = scheduled([seq])
    spec = Speculator("prompt-lookup", 4)
    spec.extend(work, sched, spare=8)
    assert seq.draft == [3, 4, 5, 6] and seq.num_computed_tokens == 7
    emitted = spec.settle(seq, [3, 4, 0, 6, 1], sched)
    assert emitted == [3, 4, 0]
    # the last token and the two agreed ones are computed; 0 is the next to compute
    assert seq.num_computed_tokens == 10 and seq.all_ids == [1, 2, 3, 4, 5, 6, 1, 2]
    assert not seq.draft and (spec.stats.draft_tokens, spec.stats.accepted_tokens) == (4, 2)
    for token in emitted:
        seq.append_token(token, None)
    assert seq.num_uncomputed == 1


def test_discard_takes_a_draft_back_out_of_its_sequence():
    seq = make_seq([1, 2, 3, 4, 5, 6, 1, 2])
    before = list(seq.all_ids)
    sched, work = scheduled([seq])
    spec = Speculator("prompt-lookup", 4)
    spec.extend(work, sched, spare=8)
    assert seq.draft
    spec.discard()
    assert not seq.draft and seq.all_ids == before and seq.num_computed_tokens == 7


def test_off_proposes_nothing_and_settings_are_checked():
    seq = make_seq([1, 2, 1])
    sched, work = scheduled([seq])
    Speculator("off").extend(work, sched, spare=8)
    assert work == [(seq, 1)] and not seq.draft
    with pytest.raises(ValueError, match="speculative must be one of"):
        Speculator("medusa")
    with pytest.raises(ValueError, match="spec_tokens"):
        Speculator("prompt-lookup", 0)


def test_a_large_batch_of_decodes_drafts_nothing():
    seqs = [make_seq([1, 2, 3, 1, 2]) for _ in range(MAX_SPECULATING_DECODES + 1)]
    sched, work = scheduled(seqs, blocks=64)
    Speculator("prompt-lookup", 4).extend(work, sched, spare=100)
    assert all(new == 1 and not seq.draft for seq, new in work)
    fewer = [make_seq([1, 2, 3, 1, 2]) for _ in range(MAX_SPECULATING_DECODES)]
    sched, work = scheduled(fewer, blocks=64)
    Speculator("prompt-lookup", 4).extend(work, sched, spare=100)
    assert all(new > 1 and seq.draft for seq, new in work)
