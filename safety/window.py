"""The safety window: a stage of the run's pipeline that holds each choice's text until its
policy's checkers pass it (design §3).

Per choice, text is held until every checker lets it go and the policy's window allows it
(`chars`: `window_chars` behind the generation front; `sentence`: at a sentence end, or once
that far behind). Redacted spans are replaced as they are released; a block drops what is held
and ends the choice with `content_filter`. What was released is never taken back. A little of
the released text is kept as context, so a pattern's lookbehind sees across a release: the
result is the same however the text was split into chunks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import regex

from adapters.events import Event, Finish, TextDelta, ToolCallDelta
from safety.checkers import Checker, Held, Span
from safety.moderation import ModerationClient
from safety.policy import REDACTION, SafetyPolicy

_CONTEXT = 64  # released characters kept for lookbehind
# a sentence ends at . ! ? or an ellipsis, maybe closed by quotes or brackets, before a space;
# at a CJK full stop, exclamation or question mark (no space follows those); or at a line break
_SENTENCE_END = regex.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*(?=\s)|[\u3002\uff01\uff1f]+|\n")
_REDACTED_LOGPROB = {"token": REDACTION, "logprob": 0.0, "bytes": None, "top_logprobs": []}


class ChoiceWindow:
    """The held text of one choice, and its checkers."""

    __slots__ = (
        "blocked",
        "buf",
        "checkers",
        "ctx",
        "finished",
        "index",
        "meter",
        "offset",
        "pending",
        "policy",
        "redacted",
    )

    def __init__(
        self, index: int, policy: SafetyPolicy, checkers: list[Checker], meter: Any
    ) -> None:
        self.index = index
        self.policy = policy
        self.checkers = checkers
        self.meter = meter
        self.buf = ""  # released context, then the held text
        self.ctx = 0  # where the held text begins in buf
        self.offset = 0  # where buf begins in the choice's whole text
        # the deltas not yet wholly released: (start, end, tokens, logprobs, arrived)
        self.pending: deque[tuple[int, int, int, list | None, float]] = deque()
        self.redacted: list[Span] = []  # spans replaced so far, in the whole text
        self.finished = False
        self.blocked = False

    async def add(self, delta: TextDelta) -> list[Event]:
        if self.finished:
            return []
        start = self.offset + len(self.buf)
        self.buf += delta.text
        self.pending.append(
            (start, start + len(delta.text), delta.tokens, delta.logprobs, time.monotonic())
        )
        return await self._release(final=False)

    async def flush(self) -> list[Event]:
        """Something other than text follows (a tool call): check what is held, release it."""
        return [] if self.finished else await self._release(final=True)

    async def close(self) -> list[Event]:
        """Nothing more follows: check the rest and release it, or block."""
        out = await self.flush()
        self.finished = True
        return out

    async def _release(self, final: bool) -> list[Event]:
        buf, ctx = self.buf, self.ctx
        if len(buf) == ctx and not final:
            return []
        held = Held(buf, ctx, final, self.offset)
        safe, spans, blocked = len(buf), [], False
        for checker in self.checkers:
            verdict = await checker.check(held)
            if verdict.error:
                self.meter.action("checker_error")
            blocked = blocked or verdict.block is not None
            if verdict.safe < safe:
                safe = verdict.safe
            spans += verdict.redact
        if blocked:  # what came before the offending text was judged: it goes, then the block
            limit = safe
        elif final:
            limit = len(buf)
        else:
            limit = min(safe, self._window_limit(buf, ctx, safe))
        for a, b in spans:  # a settled span is released whole or not at all
            if a < limit < b:
                limit = a
        out: list[Event] = []
        if limit > ctx:
            out.append(self._emit(buf, ctx, limit, [s for s in spans if s[1] <= limit]))
        if blocked:
            out += self._block()
        return out

    def _window_limit(self, buf: str, ctx: int, safe: int) -> int:
        behind = len(buf) - self.policy.window_chars
        if self.policy.mode == "sentence":
            end = ctx
            for m in _SENTENCE_END.finditer(buf, ctx, safe):
                end = m.end()
            return max(end, behind)
        return behind

    def _emit(self, buf: str, ctx: int, limit: int, spans: list[Span]) -> TextDelta:
        parts, at = [], ctx
        for a, b in sorted(spans):
            if a < at:  # overlapping detectors: one replacement covers both
                a = at
                if b <= at:
                    continue
            parts += (buf[at:a], REDACTION)
            at = b
            self.redacted.append((self.offset + a, self.offset + b))
            self.meter.action("redact")
        parts.append(buf[at:limit])
        released = self.offset + limit
        tokens, logprobs, now = 0, None, time.monotonic()
        while self.pending and self.pending[0][1] <= released:
            start, end, n, lps, arrived = self.pending.popleft()
            tokens += n
            self.meter.held(now - arrived)
            if lps is not None:
                logprobs = (logprobs or []) + self._logprobs(start, end, lps)
        cut = max(0, limit - _CONTEXT)
        self.buf, self.ctx, self.offset = buf[cut:], limit - cut, self.offset + cut
        return TextDelta("".join(parts), self.index, tokens, logprobs)

    def _logprobs(self, start: int, end: int, entries: list) -> list:
        """A redacted delta's tokens would show the text: theirs say [REDACTED] instead."""
        if any(a < end and start < b for a, b in self.redacted):
            return [_REDACTED_LOGPROB] * len(entries)
        return entries

    def _block(self) -> list[Event]:
        self.meter.action("block")
        self.finished = self.blocked = True
        self.buf, self.ctx = "", 0
        self.pending.clear()
        return [Finish("content_filter", self.index)]


class SafetyWindow:
    """The stage: a window per choice; other events of a choice wait for its text before them."""

    def __init__(
        self,
        policy: SafetyPolicy,
        n: int,
        meter: Any,
        moderation: ModerationClient | None = None,
    ) -> None:
        self.policy = policy
        self.n = n
        self.meter = meter
        self.moderation = moderation
        self.windows: dict[int, ChoiceWindow] = {}
        self.stop_source: str | None = None  # "safety" once a block ended every live choice

    def _window(self, index: int) -> ChoiceWindow:
        window = self.windows.get(index)
        if window is None:
            checkers = self.policy.checkers(self.moderation)
            window = self.windows[index] = ChoiceWindow(index, self.policy, checkers, self.meter)
        return window

    async def feed(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            kind = type(event)
            if kind is TextDelta:
                out += await self._window(event.index).add(event)
            elif kind is Finish or kind is ToolCallDelta:
                window = self._window(event.index)
                if not window.blocked:
                    out += await window.close() if kind is Finish else await window.flush()
                if not window.blocked:  # the check before it may have blocked
                    out.append(event)
            else:
                out.append(event)
        self._note_blocks()
        return out

    async def finish(self) -> list[Event]:
        out: list[Event] = []
        for index in sorted(self.windows):
            out += await self.windows[index].close()
        return out

    def _note_blocks(self) -> None:
        """Once a block ended a choice and no choice is still live, the upstream can stop."""
        ws = self.windows.values()
        if len(ws) == self.n and all(w.finished for w in ws) and any(w.blocked for w in ws):
            self.stop_source = "safety"
