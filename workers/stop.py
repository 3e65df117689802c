"""Deciding when a sequence is done, and holding back text that could begin a stop string."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.request import RequestStatus

if TYPE_CHECKING:
    from workers.request import SequenceState


class StopStringHoldback:
    """Releases text only once it cannot be the start of a stop string.

    NOTE: the pending tail is the longest suffix of the text so far that is a prefix of some stop
    string. Everything before it is safe: a stop string starting there would already be either a
    full match (found below) or a prefix of one (held). On a hit, the text before the match that
    completes first is released (the earliest end; at a tie, the earliest start) and everything
    from that stop string on is dropped. NOTE: the earliest end, not the earliest start: with
    stops "b" and "EbE", the text "EEbE" stops at "b" whether it came as one chunk or as "EEb" then
    "E" (a stream cannot wait past a completed stop string for a longer one to complete).
    """

    __slots__ = ("_pending", "_stops", "matched")

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did

    @property
    def pending(self) -> str:
        return self._pending

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text now safe to release, whether a stop string completed)."""
        if not self._stops:
            return text, False
        buffer = self._pending + text
        hits = [(i + len(s), i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            _, start, self.matched = min(hits)
            self._pending = ""
            return buffer[:start], True
        keep = self._held_suffix_len(buffer)
        cut = len(buffer) - keep
        self._pending = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        """The sequence ended without a stop string: what was held is plain text after all."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix_len(self, buffer: str) -> int:
        longest = max(len(s) for s in self._stops) - 1
        for size in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0


@dataclass(frozen=True, slots=True)
class StopContext:
    """What the model, not the request, contributes to stopping."""

    eos_token_ids: frozenset[int]
    max_model_len: int


def check_stop(seq: SequenceState, token_id: int, ctx: StopContext) -> RequestStatus | None:
    """The one place that decides whether `seq` is done after `token_id`, and why.

    Feeds the token's text through the sequence's detokenizer and hold-back (stop strings are
    text, so this is where they are found). Order: a stop token ends the sequence before its text
    is considered (its text is never shown); a stop string wins over the length limits, so a
    stop string completed by the last allowed token still reports `stop`.
    """
    params = seq.params
    if token_id in params.stop_token_ids or (
        not params.ignore_eos and token_id in ctx.eos_token_ids
    ):
        return RequestStatus.FINISHED_STOPPED
    if seq.push_text(token_id):
        return RequestStatus.FINISHED_STOPPED
    if seq.grammar is not None and seq.grammar.is_finished:
        return RequestStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= seq.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if seq.prompt_len + seq.num_output_tokens >= ctx.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
