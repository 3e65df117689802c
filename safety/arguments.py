"""A tool call's arguments through the same checkers as text (design §3).

The tool-call stage hands the window each call whole, as valid JSON, so its arguments are judged
at once: every string in them (keys and values) is shown to the policy's checkers as a final
text. A block ends the choice like a block in its text; a redaction replaces the span inside its
string, and the arguments are written out again, still valid JSON, so a blocked term or a secret
never leaves in a call either.
"""

from __future__ import annotations

import json
from typing import Any

from safety.checkers import Checker, Held, Span
from safety.policy import REDACTION


class ArgumentsVerdict:
    """What the checkers made of one call's arguments."""

    __slots__ = ("arguments", "blocked", "errors", "redactions")

    def __init__(self, arguments: str) -> None:
        self.arguments = arguments
        self.blocked = False
        self.errors = 0
        self.redactions = 0


async def check_arguments(arguments: str, checkers: list[Checker]) -> ArgumentsVerdict:
    """Judge every string of `arguments` (JSON; anything else is judged as one text)."""
    verdict = ArgumentsVerdict(arguments)
    try:
        value = json.loads(arguments)
    except ValueError:
        checked = await _check_text(arguments, checkers, verdict)
        if verdict.redactions:
            verdict.arguments = checked
        return verdict
    checked = await _walk(value, checkers, verdict)
    if verdict.redactions and not verdict.blocked:
        verdict.arguments = json.dumps(checked, ensure_ascii=False)
    return verdict


async def _walk(value: Any, checkers: list[Checker], verdict: ArgumentsVerdict) -> Any:
    if isinstance(value, str):
        return await _check_text(value, checkers, verdict)
    if isinstance(value, list):
        return [await _walk(item, checkers, verdict) for item in value]
    if isinstance(value, dict):
        return {
            await _check_text(k, checkers, verdict): await _walk(v, checkers, verdict)
            for k, v in value.items()
        }
    return value


async def _check_text(text: str, checkers: list[Checker], verdict: ArgumentsVerdict) -> str:
    if verdict.blocked or not text:
        return text
    spans: list[Span] = []
    for checker in checkers:
        judged = await checker.check(Held(text, 0, final=True))
        verdict.errors += judged.error
        if judged.block is not None:
            verdict.blocked = True
            return text
        spans += judged.redact
    if not spans:
        return text
    parts, at = [], 0
    for a, b in sorted(spans):
        if b <= at:
            continue
        if a >= at:
            parts += (text[at:a], REDACTION)
            verdict.redactions += 1
        at = b
    parts.append(text[at:])
    return "".join(parts)
