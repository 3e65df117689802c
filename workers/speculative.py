"""Prompt-lookup speculative decoding: drafts from a sequence's own tokens, checked in one pass.

A greedy sequence often repeats what it has already seen (a summary quoting its input, an edit of
the code in the prompt). Before a step, the speculator looks up the sequence's last n tokens
(n = 3, then 2, then 1) earlier in its prompt and output, and proposes the up to `k` tokens that
followed the latest match. They ride in the step as a short chunk after the last token; the model
runner keeps the logits of every position, the target's greedy choice at each is compared with
the draft, and the sequence takes the longest agreeing prefix plus the target's own next token
(its correction at the first mismatch, or a bonus token when every draft token was right).
Greedy output is therefore what one-token decoding gives, token for token in float32.

NOTE on bfloat16: the engine's own forward (paged attention, fused projections) rounds
differently from transformers' `generate`, with or without speculation, so at a near-tie both
part from `generate` at the same token. Measured (2026-12, CPU): SmolLM2-135M-Instruct on
bench/speculative.py's first 4 prompts, 48 greedy tokens: without speculation 2/4 outputs equal
`generate` (first differences at tokens 8 and 31), one request at a time and 4 batched alike;
with speculation the same 2/4, and 4/4 equal the non-speculative engine's token for token, at
c=1 and c=4. The tests' tiny model (4 prompts, 40 tokens; plain, attention-damped and looping
copies): without speculation 1/4, 1/4 and 3/4 equal `generate` (the looping copy's odd one
differs at its first token, which comes from the prefill alone), with speculation 12/12 equal
the non-speculative engine's. The bfloat16 gap is the engine's kernels, not speculation or
batching.

NOTE on the KV cache: the draft's KV is written like any chunk's, but `num_computed_tokens`
advances only over the accepted tokens, so slots written for rejected ones lie past the committed
part and are overwritten by the next step; a block is hashed only once every position in it is
computed (block_manager.register_computed), so a rejected token's KV can never be shared. Blocks
grown for the draft stay in the sequence's table (its next tokens fill them) and go back with the
rest when it ends or is preempted.

Only plain greedy sequences speculate: sampled rows (temperature > 0) would need rejection
sampling to keep their distribution, grammar-constrained rows advance a matcher per token, and
penalties make each position's choice depend on the tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.worker_settings import DEFAULT_SPEC_TOKENS, DEFAULT_SPECULATIVE, SPECULATIVE_MODES

if TYPE_CHECKING:
    from workers.request import SequenceState
    from workers.scheduler import Scheduler

# NOTE: each verifying sequence is a chunk of its own in the attention (its own call per layer),
# where plain decodes share one batched call: past a few decodes a step, the extra calls cost more
# than the accepted tokens save (bench/speculative.py at c=8 on a CPU), so larger batches decode
# one token at a time.
MAX_SPECULATING_DECODES = 4
MAX_NGRAM = 3
MIN_NGRAM = 1


class NgramIndex:
    """Where each n-gram (n = 1 … MAX_NGRAM) of a growing token list last ended.

    Built incrementally: each lookup indexes only the positions added since the last one, so a
    step costs O(new tokens), not O(sequence length).
    """

    __slots__ = ("_indexed", "_last_end")

    def __init__(self) -> None:
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (MAX_NGRAM down to MIN_NGRAM tokens) found; [] when none occurs."""
        last = len(tokens) - 1  # the suffix ends here: index only what ends before it
        for end in range(self._indexed, last):
            for n in range(1, min(MAX_NGRAM, end + 1) + 1):
                self._last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, last)
        if k < 1:
            return []
        for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
            end = self._last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + k])
        return []


def accepted_tokens(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """What a verification emits: the draft's longest prefix the target agrees with, then the
    target's own token after it. `targets[i]` is the target's choice after draft[:i]."""
    assert len(targets) == len(draft) + 1, "one target per draft token, plus the next"
    agreed = 0
    while agreed < len(draft) and draft[agreed] == targets[agreed]:
        agreed += 1
    return list(targets[: agreed + 1])


def can_speculate(seq: SequenceState) -> bool:
    """A sequence decoding plainly and greedily (see the module docstring for why only those).

    NOTE: a prompt's first token is never speculated: the choices of `n > 1` fork from the
    leader's KV when it samples it."""
    p = seq.params
    return (
        p.greedy
        and not p.has_penalties
        and seq.grammar is None
        and bool(seq.output_ids)
        and seq.num_uncomputed == 1
    )


@dataclass(slots=True)
class SpecStats:
    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0  # of those, the ones the target agreed with
    verifications: int = 0  # sequence-steps that verified a draft


class Speculator:
    """Extends a step's scheduled decodes with drafts, and settles them once the step ran.

    A draft sits at the end of `seq.all_ids` (and in `seq.draft`) from `extend` until `settle`
    or `discard`. It is spare work: it takes only the step's unused token budget (with a
    step-time target, the tokens still fitting under it: Scheduler.spare_tokens) and blocks
    that are free, never preempts, and never displaces a decode or a prefill chunk. A step with more
    than MAX_SPECULATING_DECODES decodes drafts nothing."""

    def __init__(
        self, mode: str = DEFAULT_SPECULATIVE, spec_tokens: int = DEFAULT_SPEC_TOKENS
    ) -> None:
        if mode not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, not {mode!r}"
            )
        if spec_tokens < 1:
            raise ValueError(f"spec_tokens must be at least 1, not {spec_tokens}")
        self.enabled = mode != "off"
        self.spec_tokens = spec_tokens
        self.stats = SpecStats()
        self._drafted: list[SequenceState] = []

    def extend(
        self, work: list[tuple[SequenceState, int]], scheduler: Scheduler, spare: int
    ) -> int:
        """Give each eligible decode in `work` a draft (in place: its entry then computes the
        draft too), within `spare` tokens, never more than its `max_tokens` leaves room for
        (the verification adds one token of the target's own); returns the draft tokens added."""
        drafted = 0
        if not self.enabled or sum(new == 1 for _, new in work) > MAX_SPECULATING_DECODES:
            return drafted
        for i, (seq, new) in enumerate(work):
            if spare < 1:
                break
            if new != 1 or not can_speculate(seq):
                continue
            room = min(self.spec_tokens, seq.max_tokens - seq.num_output_tokens - 1, spare)
            if seq.ngrams is None:
                seq.ngrams = NgramIndex()
            draft = seq.ngrams.propose(seq.all_ids, room)
            if not draft or not scheduler.reserve(seq, len(seq.all_ids) + len(draft)):
                continue
            seq.draft = draft
            seq.all_ids.extend(draft)
            work[i] = (seq, 1 + len(draft))
            spare -= len(draft)
            drafted += len(draft)
            self._drafted.append(seq)
        return drafted

    def discard(self) -> None:
        """Drafts not settled (the step failed): they leave their sequences."""
        for seq in self._drafted:
            del seq.all_ids[len(seq.all_ids) - len(seq.draft) :]
            seq.draft = []
        self._drafted = []

    def settle(self, seq: SequenceState, targets: Sequence[int], scheduler: Scheduler) -> list[int]:
        """Commit the accepted part of `seq`'s draft to its KV and return the tokens to emit
        (which the caller appends as output, one by one, like sampled ones)."""
        draft = seq.draft
        emitted = accepted_tokens(draft, targets)
        agreed = len(emitted) - 1
        base = len(seq.all_ids) - len(draft)  # the tokens before the draft
        del seq.all_ids[base + agreed :]  # NOTE: a rejected token never counts as computed
        scheduler.computed([(seq, 1 + agreed)])
        del seq.all_ids[base:]
        seq.draft = []
        self._drafted.remove(seq)
        self.stats.draft_tokens += len(draft)
        self.stats.accepted_tokens += agreed
        self.stats.verifications += 1
        return emitted
