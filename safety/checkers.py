"""The checker interface and the built-in checkers.

A checker sees the window's text (a little released context, then the held text) and answers
with a `Verdict`: how far the held text may be released as far as it is concerned, which spans
to redact, or a block. The window releases the least any checker allows (design §3), so a
checker that needs to see more before it can judge simply answers a shorter `safe`.

Adding a checker is one class with `check` and one entry in `safety.policy.CHECKERS`, which
builds each choice's checkers from a policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import regex

from safety.detectors import DETECTORS

Span = tuple[int, int]


@dataclass(slots=True)
class Verdict:
    """`safe`: text before this offset may go (no match can still begin before it); `redact`:
    spans, final, to replace with [REDACTED]; `block`: why the run must stop (None: it need
    not). Offsets are into the text the checker was shown."""

    safe: int
    redact: list[Span] = field(default_factory=list)
    block: str | None = None
    error: bool = False  # the checker failed (a remote one timed out, …); `block` says the upshot


@dataclass(slots=True, frozen=True)
class Held:
    """What a checker is shown: `text[start:]` is the held text it has not judged yet (a checker
    goes on from where its last verdict left it), `text[:start]` is context (released, or judged
    before: for lookbehind); `offset` is where `text` begins in the choice's whole text;
    `final`: nothing more will follow it."""

    text: str
    start: int
    final: bool = False
    offset: int = 0


class Checker(Protocol):
    name: str

    async def check(self, held: Held) -> Verdict:
        """The checker's verdict on the held text."""


def scan(
    pattern: regex.Pattern[str],
    text: str,
    start: int,
    final: bool,
    within: Callable[[str], list[Span]] | None = None,
) -> tuple[int, list[Span]]:
    """The matches of `pattern` in `text[start:]` that are settled, and how far the text is
    clear. A tail that could begin a match (regex's partial matching) may yet become one, and a
    match could still grow if what follows it so far might lead into a longer one (a greedy
    pattern: `a@b.co` before `.uk` arrives), so the text is clear only up to them."""
    end = len(text)
    safe, spans = end, []
    for m in pattern.finditer(text, pos=start, partial=not final):
        a, b = m.span()
        if not final and (
            m.partial or b == end or pattern.fullmatch(text, pos=a, partial=True) is not None
        ):
            if a < end:
                safe = a
            break
        if within is None:
            spans.append((a, b))
        else:
            spans += [(a + x, a + y) for x, y in within(m.group())]
    return safe, spans


class BlockTerms:
    """Terms and regexes that end the run (`content_filter`) the moment one appears."""

    name = "block_terms"

    def __init__(self, pattern: regex.Pattern[str]) -> None:
        self.pattern = pattern

    async def check(self, held: Held) -> Verdict:
        safe, spans = scan(self.pattern, held.text, held.start, held.final)
        if spans:
            return Verdict(spans[0][0], block=self.name)
        return Verdict(safe)


class Redactor:
    """One built-in detector (e-mail, phone, card, secret): its matches become [REDACTED]."""

    def __init__(self, detector: str) -> None:
        self.detector = DETECTORS[detector]
        self.name = f"redact:{detector}"

    async def check(self, held: Held) -> Verdict:
        d = self.detector
        safe, spans = scan(d.pattern, held.text, held.start, held.final, d.within)
        return Verdict(safe, redact=spans)
