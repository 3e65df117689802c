"""How many tokens the next engine step may take so that it ends within a target time.

A step's duration grows with its tokens: a fixed part (launches, Python, the decode attention
setup) plus a per-token part. `StepTimeModel` fits `seconds = fixed + per_token x tokens` on the
fly, as exponentially weighted least squares over the steps that ran, so it follows the device,
the model, the batch's context lengths and a busy machine without a calibration run.
`StepBudget` turns that fit into the share of a step prefill may take: decodes always run, and
prefill chunks get the time left under the target. The clock is injected (tests drive a fake
one); the engine times a step on the host around the point where the sampled tokens are read
back anyway, so timing never adds a device sync.

Launches are priced apart from tokens. On a GPU a decode-only step replays one CUDA graph
(decode_graphs.py) while a step with prefill or drafts runs eagerly and launches every kernel
itself, a fixed part ten times the replay's for a small model. The fit is the eager steps' alone:
a replayed step teaches only the cadence (the gap streams see). Fitted through both, one line
read the replays' jump to an eager step as per-token cost and shrank each prompt's chunk below
the last, so each eager step paid the launches for a few tokens (and a draft looked as cheap as
a replay). On a CPU nothing is replayed and the fit is every step's, as before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

Clock = Callable[[], float]

EWMA_WEIGHT = 0.1  # the newest step's share: about the last 20 steps count
RECENT_STEPS = 8  # steps whose seconds per token bound the slope (short: a slowdown shows soon)
# NOTE: when decodes alone already outrun the target (a slow device, a big batch), prefill
# still gets this share of the decodes' own time, so queued prompts keep moving and a step with
# prefill stays within about 1.5x a decode-only step (more while prompts outnumber decodes).
MIN_PREFILL_SHARE = 0.5
# A step that carries prefill (or drafts) beside its decodes ends within this many times the
# decodes' own step time, as well as within the target: a stream's slowest gaps then stay under
# twice its usual one (ITL p99 <= 2x p50) however fast the decode step is. NOTE: with the 50 ms
# target alone, a decode step made faster (12.5 ms at c=16 with the CPU decode kernel) left
# prefill four decode steps' time, and the Poisson bench's ITL p99/p50 went from 1.9 to 4.1.
ITL_RATIO = 1.8
# ... but never below this: a gap this short is a cadence no client can tell from a steady one
# (40 tokens/s), and a cap of a few ms (a small model's steps) would make how many tokens a
# draft gets a matter of timing noise, where a repeated greedy request should stream the same
# events (the drafts decide how many tokens a step emits together).
ITL_FLOOR_S = 0.025
TRUST_GROWTH = 2  # a step may run this many times the tokens of the largest recent step
# NOTE: the cadence the target keeps is that of decodes already streaming. A decode with fewer
# tokens than this is still coming in with its wave: while every decode is that young, prefill
# takes the fixed budget, so a burst of prompts starts together. Let in at half a decode step's
# time a chunk at a time, a wave of 32 started over 30 steps instead of 4, and since a batch
# that starts staggered also ends staggered, the wave's throughput fell to 0.83x.
SETTLED_TOKENS = 8
# NOTE: the cadence is measured on decode-only steps, and a backlog (embeddings queued all the
# while, prompts arriving faster than they start) can give every step a chunk: then the cadence
# was never learned, the fit's line ran through chunked steps only and priced 7 decodes alone at
# 150 ms where they took 85 (CPU, float32), and steps with embedding chunks ran 2.1-2.8x a
# decode-only step. So after this many steps with decodes and prefill and no decode-only one, a
# step runs its decodes alone (no prefill, no embedding chunk, no drafts): the cadence is
# measured, and the fit gets a point at the decodes' own size. Steps with drafts but no prefill
# do not count: under Poisson arrivals half the steps carry drafts, and counted they made 2.5%
# of steps hold their prompts back while no backlog was there.
CADENCE_EVERY = 16


class StepTimeModel:
    """Weighted least squares of step seconds against step tokens, newest steps weighing most."""

    def __init__(self, weight: float = EWMA_WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], not {weight}")
        self.weight = weight
        self.steps = 0
        self._x = self._y = self._xx = self._xy = 0.0  # weighted means of t, s, t^2, t*s
        self._per_token: deque[float] = deque(maxlen=RECENT_STEPS)  # each recent step's s / t
        self._tokens: deque[int] = deque(maxlen=RECENT_STEPS)  # each recent step's t

    def observe(self, tokens: int, seconds: float) -> None:
        """One step ran `tokens` tokens in `seconds`."""
        if tokens < 1 or seconds < 0:
            return
        w = 1.0 if self.steps == 0 else self.weight
        self._x += w * (tokens - self._x)
        self._y += w * (seconds - self._y)
        self._xx += w * (tokens * tokens - self._xx)
        self._xy += w * (tokens * seconds - self._xy)
        self._per_token.append(seconds / tokens)
        self._tokens.append(tokens)
        self.steps += 1

    @property
    def largest(self) -> int:
        """The most tokens a recent step ran: how far the fit has been seen to hold."""
        return max(self._tokens, default=0)

    @property
    def per_token(self) -> float | None:
        """Marginal seconds per token; None before the first step.

        NOTE: a step of n tokens in s seconds bounds the slope by s / n (its fixed part is not
        negative), and the largest recent steps bound it tightest. The fit is clamped to that
        bound, which is also the cautious guess while the steps' sizes have not spread enough
        to read a slope (or noise makes it negative): a busy machine's long fixed part then
        does not pass for per-token cost and starve prefill."""
        if self.steps == 0:
            return None
        bound = min(self._per_token)
        variance = self._xx - self._x * self._x
        if variance < 1.0:  # step sizes within about a token of each other: no slope to read
            return bound
        slope = (self._xy - self._x * self._y) / variance
        return bound if slope <= 0 else min(slope, bound)

    def predict(self, tokens: int) -> float | None:
        """Expected seconds of a step of `tokens` tokens; None before the first step."""
        slope = self.per_token
        if slope is None:
            return None
        fixed = self._y - slope * self._x
        return fixed + slope * tokens


class StepBudget:
    """The prefill tokens a step may add to its decodes and still end within `target_s`, and
    within ITL_RATIO times the decodes' own time."""

    def __init__(self, target_s: float, floor: int, clock: Clock = time.perf_counter) -> None:
        if not target_s > 0:
            raise ValueError(f"target_s must be positive, not {target_s}")
        self.target_s = target_s
        self.floor = max(1, floor)
        self.clock = clock
        self.model = StepTimeModel()
        # Seconds of a decode-only step (no prefill, no drafts), weighted to the newest: the
        # cadence streams see. The main fit prices a step's tokens; read at a few decodes it
        # overstated a decode-only step by half (its line runs through steps with chunks and
        # drafts, whose attention costs more a token), and a decode-only step hardly grows
        # with its decodes on a CPU at 1-6 (11-15 ms here); a batch that grows moves it.
        self.cadence: float | None = None
        # Seconds a draft token adds to a step beyond what the fit prices its other tokens at,
        # weighted to the newest. NOTE: a verifying sequence costs more a token than a prompt's
        # chunk (a span of its own in attention, a logits row and an acceptance check per draft
        # token), and the fit, learned mostly from prefill, priced the drafts of a step at half
        # what they took (CPU, bfloat16, c=16: 40 ms measured against 23 predicted); those steps
        # were the ITL tail's.
        self.draft_cost: float | None = None
        self._started: float | None = None
        self._unmeasured = CADENCE_EVERY  # steps with prefill since a decode-only one was due

    def prefill_tokens(
        self,
        decode_tokens: int,
        limit: int,
        prompts: int = 1,
        settled: int | None = None,
        floor: int | None = None,
    ) -> int:
        """Prefill tokens for a step with `decode_tokens` decodes, `settled` of them streaming
        for SETTLED_TOKENS or more (None: all), at most `limit`, while `prompts` prompts wait
        for theirs.

        Never below `floor` (the budget's own unless given: prompts always move), never above
        `limit` (the fixed budget); all of `limit` when no decode has settled (no cadence to
        keep yet) or nothing has been measured yet.

        NOTE: when decodes alone outrun the target, prefill gets a share of the decodes' time:
        MIN_PREFILL_SHARE, times prompts / decodes while prompts outnumber decodes (a waiting
        prompt's client has nothing yet; a decode's gets its next token a little later). With
        the share fixed, a burst of 64 prompts went in 30-token chunks beside the first
        decodes, and a wave's throughput fell to 0.73x. The share stops at ITL_RATIO - 1: a
        queue that outgrows the engine (Poisson arrivals above its rate) otherwise gave prefill
        up to 2.5x a decode step's time and made the ITL tail; capped, waves kept their
        tokens/s (1.03x, 1.00x at c=32, 64) and the queue's TTFT pays instead."""
        if decode_tokens == 0 or settled == 0:
            return limit
        slope = self.model.per_token
        decodes_s = self.model.predict(decode_tokens)
        if slope is None or decodes_s is None or slope <= 0:
            return limit
        share = min(ITL_RATIO - 1, MIN_PREFILL_SHARE * max(1.0, prompts / decode_tokens))
        room = max(self._target(decodes_s) - decodes_s, share * decodes_s)
        # NOTE: a step's cost is not linear in its tokens: a small chunk rides on the decodes'
        # weight reads almost free, a large one pays full compute (CPU, float32: a fit read off
        # 20-40-token chunks priced 254 tokens at 190 ms; they took 500). So a step grows to at
        # most twice the largest recently measured, and the fit learns the new size first.
        trusted = TRUST_GROWTH * self.model.largest - decode_tokens
        floor = self.floor if floor is None else floor
        return max(0, min(limit, max(floor, min(int(room / slope), trusted))))

    def cadence_due(self) -> bool:
        """Whether this step should run its decodes alone, to measure the cadence (see
        CADENCE_EVERY); once True, not again for CADENCE_EVERY steps, whatever the step held."""
        if self._unmeasured < CADENCE_EVERY:
            return False
        self._unmeasured = 0
        return True

    def spare_tokens(self, step_tokens: int, limit: int, decode_tokens: int = 0) -> int:
        """Tokens a scheduled step of `step_tokens`, `decode_tokens` of them decodes, may still
        add (speculative drafts) and end within the target, at most `limit`; all of `limit`
        before anything was measured.

        NOTE: unlike prefill there is no floor and no share past the target: this work is
        optional, so a step already at the target gets none."""
        slope = self.model.per_token
        step_s = self.model.predict(step_tokens)
        if slope is None or step_s is None or slope <= 0:
            return limit
        target = self.target_s
        if decode_tokens and (decodes_s := self.model.predict(decode_tokens)) is not None:
            target = self._target(decodes_s)
        price = slope if self.draft_cost is None else max(slope, self.draft_cost)
        return max(0, min(limit, int((target - step_s) / price)))

    def _target(self, decodes_s: float) -> float:
        """The time a step whose decodes take `decodes_s` by the main fit may run to: the
        target, and ITL_RATIO times a decode-only step as measured (the cadence), or
        ITL_FLOOR_S."""
        alone = decodes_s if self.cadence is None else min(decodes_s, self.cadence)
        return min(self.target_s, max(ITL_FLOOR_S, ITL_RATIO * alone))

    def started(self) -> None:
        """The step's work is decided; its time runs from here."""
        self._started = self.clock()

    def ended(
        self,
        tokens: int,
        decodes: int,
        shaped: bool = True,
        drafts: int = 0,
        replayed: bool = False,
    ) -> None:
        """The step's results are on the host: learn from how long its `tokens` took, unless
        its prefill was not `shaped` by the target (it took the whole budget beside decodes
        that had not settled); `drafts` of them were speculative draft tokens, whose own price
        is learned from what the step took beyond the fit's price of the rest. A `replayed`
        step (one CUDA graph launch, decodes only) sets the cadence and leaves the eager fit.

        NOTE: a step without decodes is not learned from. The budget only shapes steps with
        decodes, and a prompt-only step's long GEMMs cost less a token than a chunk adds to a
        decode step (CPU, float32: 1.6 against 2.9 ms). Learned, its seconds per token became the
        slope's bound, the fit's fixed part grew to match, and steps with a chunk ran 2.3x a
        decode-only step where 1.5x was meant. A wave's whole-budget steps are such long GEMMs
        too, and would also widen how far the fit is trusted to grow a step."""
        if self._started is not None and decodes > 0 and shaped:
            seconds = self.clock() - self._started
            weight = self.model.weight
            if not replayed:
                if drafts and (rest := self.model.predict(tokens - drafts)) is not None:
                    per_draft = max(0.0, seconds - rest) / drafts
                    self.draft_cost = _weighted(self.draft_cost, per_draft, weight)
                self.model.observe(tokens, seconds)
            if tokens == decodes:
                self.cadence = _weighted(self.cadence, seconds, weight)
                self._unmeasured = 0
            elif tokens - drafts > decodes:  # it carried prefill (drafts alone do not count)
                self._unmeasured += 1
        self._started = None


def _weighted(average: float | None, value: float, weight: float) -> float:
    """An exponentially weighted average moved toward `value` (`value` itself if none yet)."""
    return value if average is None else average + weight * (value - average)
