"""What a run streamed from a pool member so far, so that another member can continue it
(design §6).

A member that dies or hangs mid-stream leaves the run with the text its client already has.
Our own workers send the token ids of every line (worker API v3), so the pool keeps the ids of
choice 0 as they pass and asks the next member for the same request with `continuation` set to
them: that worker prefills prompt + those tokens, replays them through its stop-string and
tool-call state, and generates on. The client's stream goes on with no gap and nothing repeated;
with greedy decoding the text equals an uninterrupted run's, and the usage the worker reports
counts both members' tokens. Runs that cannot be continued so: more than one choice, a token
without its ids (an OpenAI-compatible member), or no member able to take a continuation. A run
cut before its first token (queued on the member) starts afresh on any member.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from adapters.events import Accepted, Admitted, Event, Finish, TextDelta, ToolCallDelta
from adapters.requests import ChatRequest

MAX_MIGRATIONS = 3  # members a run may move to before it is failed


@dataclass(slots=True)
class RunProgress:
    """One request's stream through the pool: what was passed on, and what to ask next."""

    original: ChatRequest
    ids: list[int] = field(default_factory=list)  # choice 0's token ids passed on
    started: bool = False  # a batch reached the run: a failure now is mid-stream
    traced: bool = True  # every token passed on came with its ids
    generated: bool = False  # a token of any choice passed on (before: any member may start it)
    finished: bool = False  # choice 0 finished: nothing is left to continue
    aborting: bool = False  # the run asked its member to stop: a failure now is no migration
    migrations: int = 0
    migrating: bool = False  # the member streaming now is continuing the run

    @property
    def request(self) -> ChatRequest:
        """What the next member is asked: the request, or its continuation."""
        if not self.ids:
            return self.original
        return replace(self.original, continuation=list(self.ids))

    def passed(self, batch: list[Event]) -> list[Event]:
        """Note what `batch` carries; what of it goes on to the run (a continuing member's
        `start` and `admitted` were already reported by the first)."""
        self.started = True
        if self.migrating:
            batch = [e for e in batch if type(e) is not Accepted and type(e) is not Admitted]
        for event in batch:
            kind = type(event)
            if kind is TextDelta or kind is ToolCallDelta:
                self.generated = True
            if (kind is TextDelta or kind is ToolCallDelta) and event.index == 0:
                ids = event.token_ids
                if ids is None or (kind is TextDelta and len(ids) != event.tokens):
                    self.traced = False  # a token without its id: nothing exact to resubmit
                else:
                    self.ids.extend(ids)
            elif kind is Finish and event.index == 0:
                self.finished = True
        return batch

    def why_not_continued(self) -> str | None:
        """None when the run can move to another member now; else the outcome to count."""
        if self.aborting or self.finished:
            return "not_needed"
        if self.generated and (self.original.n != 1 or not self.traced):
            return "not_continuable"
        if self.migrations >= MAX_MIGRATIONS:
            return "failed"
        return None
