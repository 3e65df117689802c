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
from dataclasses import replace
from typing import Any

import regex

from adapters.events import Event, Finish, TextDelta, ToolCallDelta
from safety.arguments import check_arguments
from safety.checkers import Checker, Held, Span
from safety.moderation import ModerationClient
from safety.policy import REDACTION, SafetyPolicy

_CONTEXT = 64  # released characters kept for lookbehind
# NOTE: a verdict stays true as text is appended (no match can begin before a checker's `safe`,
# whatever follows, and settled spans stay settled), so the checkers are asked again only when
# the window would release past what they judged, or this much new text came: a block is still
# found within a few tokens of its arrival (and the upstream stopped), at a fraction of the CPU.
_RESCAN_CHARS = 16
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
        "judged",
        "judged_spans",
        "meter",
        "offset",
        "pending",
        "policy",
        "progress",
        "redacted",
        "scanned_front",
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
        # the checkers' last verdict, in the whole text: judged up to here, with these spans
        self.judged = 0
        self.judged_spans: list[Span] = []
        self.scanned_front = 0
        self.progress = [0] * len(checkers)  # how far each checker has judged the text

    def add(self, delta: TextDelta) -> bool:
        """Hold a delta; whether there is new text to judge (`release` then judges it)."""
        if self.finished:
            return False
        start = self.offset + len(self.buf)
        self.buf += delta.text
        self.pending.append(
            (start, start + len(delta.text), delta.tokens, delta.logprobs, time.monotonic())
        )
        return True

    async def release(self) -> list[Event]:
        """What of the held text may go now (judged once for all the deltas added since)."""
        return [] if self.finished else await self._release(final=False)

    async def flush(self) -> list[Event]:
        """Something other than text follows (a tool call): check what is held, release it."""
        return [] if self.finished else await self._release(final=True)

    async def close(self) -> list[Event]:
        """Nothing more follows: check the rest and release it, or block."""
        out = await self.flush()
        self.finished = True
        return out

    async def _release(self, final: bool) -> list[Event]:
        buf, ctx, offset = self.buf, self.ctx, self.offset
        front = offset + len(buf)
        if front == offset + ctx and not final:
            return []
        judged = self.judged - offset
        limit = len(buf) if final else self._window_limit(buf, ctx, len(buf))
        blocked = False
        if final or limit > judged or front - self.scanned_front >= _RESCAN_CHARS:
            blocked = await self._judge(final)
            judged = self.judged - offset
            if blocked:  # what came before the offending text was judged: it goes, then the block
                limit = judged
            elif not final:
                limit = self._window_limit(buf, ctx, judged)
        limit = min(limit, judged)
        spans = [(a - offset, b - offset) for a, b in self.judged_spans]
        limit = _outside_spans(limit, spans)
        out: list[Event] = []
        if limit > ctx:
            if spans:
                spans = [s for s in spans if ctx <= s[0] and s[1] <= limit]
            out.append(self._emit(buf, ctx, limit, spans))
        if blocked:
            out += self._block()
        return out

    async def _judge(self, final: bool) -> bool:
        """Ask every checker about the text it has not judged yet (each goes on from where its
        last verdict left it); keep how far the text is judged and the spans to redact;
        whether one blocked."""
        buf, offset, ctx = self.buf, self.offset, self.ctx
        blocked = False
        for i, checker in enumerate(self.checkers):
            start = max(ctx, self.progress[i] - offset)
            verdict = await checker.check(Held(buf, start, final, offset))
            if verdict.error:
                self.meter.action("checker_error")
            blocked = blocked or verdict.block is not None
            self.progress[i] = offset + verdict.safe
            if verdict.redact:
                self.judged_spans += [(offset + a, offset + b) for a, b in verdict.redact]
        self.judged = min(self.progress, default=offset + len(buf))
        self.scanned_front = offset + len(buf)
        return blocked

    def _window_limit(self, buf: str, ctx: int, judged: int) -> int:
        behind = len(buf) - self.policy.window_chars
        if self.policy.mode == "sentence" and judged > ctx:
            end = ctx
            for m in _SENTENCE_END.finditer(buf, ctx, judged):
                end = m.end()
            return max(end, behind)
        return behind

    def _emit(self, buf: str, ctx: int, limit: int, spans: list[Span]) -> TextDelta:
        parts, at = [], ctx
        for a, b in sorted(spans):
            if a < at:  # overlapping detectors: one replacement covers both
                if b > at:
                    self.redacted.append((self.offset + at, self.offset + b))
                    at = b
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
        if self.redacted:
            oldest = self.pending[0][0] if self.pending else released
            self.redacted = [s for s in self.redacted if s[1] > oldest]
        if self.judged_spans:
            self.judged_spans = [s for s in self.judged_spans if s[0] >= released]
        return TextDelta("".join(parts), self.index, tokens, logprobs)

    def _logprobs(self, start: int, end: int, entries: list) -> list:
        """A redacted delta's tokens would show the text: theirs say [REDACTED] instead."""
        if any(a < end and start < b for a, b in self.redacted):
            return [_REDACTED_LOGPROB] * len(entries)
        return entries

    def close_blocked(self) -> list[Event]:
        """Something other than text was blocked (a tool call): the choice ends here."""
        return self._block()

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
        ended = False  # a choice finished or was blocked: maybe none is live now
        added: dict[int, ChoiceWindow] = {}  # held new text, judged once at the batch's end
        for event in events:
            kind = type(event)
            if kind is TextDelta:
                window = self._window(event.index)
                if window.add(event):
                    added[event.index] = window
            elif kind is Finish or kind is ToolCallDelta:
                window = self._window(event.index)
                added.pop(event.index, None)
                ended = True
                if not window.blocked:
                    out += await window.close() if kind is Finish else await window.flush()
                if not window.blocked and kind is ToolCallDelta:
                    out += await self._check_call(window, event)
                elif not window.blocked:  # the check before it may have blocked
                    out.append(event)
            else:
                out.append(event)
        for window in added.values():
            out += await window.release()
            ended = ended or window.blocked
        if ended:
            self._note_blocks()
        return out

    async def _check_call(self, window: ChoiceWindow, call: ToolCallDelta) -> list[Event]:
        """A whole call, judged by a fresh set of the policy's checkers: the call as released,
        or the choice blocked."""
        verdict = await check_arguments(call.arguments, self.policy.checkers(self.moderation))
        for _ in range(verdict.errors):
            self.meter.action("checker_error")
        if verdict.blocked:
            return window.close_blocked()
        for _ in range(verdict.redactions):
            self.meter.action("redact")
        if verdict.arguments == call.arguments:
            return [call]
        return [replace(call, arguments=verdict.arguments)]

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


def _outside_spans(limit: int, spans: list[Span]) -> int:
    """The release point pulled back until no settled span straddles it: a span is released
    whole or not at all. NOTE: pulling back to one span's start can land inside another that
    overlaps it (two detectors matching the same text, a secret run into a card number), so
    this repeats until nothing moves."""
    moved = True
    while moved:
        moved = False
        for a, b in spans:
            if a < limit < b:
                limit, moved = a, True
    return limit
