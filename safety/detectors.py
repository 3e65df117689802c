"""Built-in redaction detectors: what personal data and secrets look like in streamed text.

Each detector is a pattern and, where a pattern alone over-matches, a validator (a card number
must pass the Luhn check). Patterns are written for the `regex` module's partial matching, which
tells the window whether the held text's tail could still become a match (design §3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import regex


def luhn_valid(digits: str) -> bool:
    """The card-number checksum: doubles every second digit from the right."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_spans(match: str) -> list[tuple[int, int]]:
    """The card number in a run of digit groups: the whole run when it passes the Luhn check,
    else the longest run of whole groups that does. A card is often written next to other
    digits (its expiry `12/25`, a CVV, an amount before it), which the pattern takes in too."""
    groups = [m.span() for m in _DIGIT_GROUP.finditer(match)]
    best: tuple[int, int] | None = None
    for i in range(len(groups)):
        for j in range(i, len(groups)):
            a, b = groups[i][0], groups[j][1]
            digits = "".join(match[x:y] for x, y in groups[i : j + 1])
            longer = best is None or b - a > best[1] - best[0]
            if longer and 13 <= len(digits) <= 19 and luhn_valid(digits):
                best = (a, b)
    return [] if best is None else [best]


_DIGIT_GROUP = regex.compile(r"\d+")


@dataclass(slots=True, frozen=True)
class Detector:
    name: str
    pattern: regex.Pattern[str]
    # what of a match counts, as spans within it (a card number must pass the Luhn check);
    # None: the whole match
    within: Callable[[str], list[tuple[int, int]]] | None = None


def _compile(source: str) -> regex.Pattern[str]:
    return regex.compile(source, regex.VERSION1)


_SECRET = "|".join(
    (
        r"\bsk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_\-]{20,}",  # OpenAI, Anthropic, Stripe
        r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",  # AWS access key ids
        r"\bgh[pousr]_[A-Za-z0-9]{36,}",  # GitHub tokens
        r"\bgithub_pat_[A-Za-z0-9_]{40,}",
        r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",  # Slack
        r"\bAIza[0-9A-Za-z_\-]{35}",  # Google API keys
        r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",  # JWTs
        # a PEM block from its header on: through its footer, or, cut off before one, as far as
        # its body goes (base64, and an encrypted key's `Proc-Type: 4,ENCRYPTED` and
        # `DEK-Info: AES-128-CBC,…` lines); a header alone, the key still streaming, is held
        r"-----BEGIN [A-Z0-9 ]{1,40}-----"
        r"(?:Proc-Type: ?\d,[A-Z]+|DEK-Info: ?[A-Z0-9\-]+,[0-9A-Fa-f]+|[A-Za-z0-9+/=\r\n])"
        r"{0,8192}(?:-----END [A-Z0-9 ]{1,40}-----)?",
    )
)

DETECTORS: dict[str, Detector] = {
    "email": Detector(
        "email",
        _compile(
            r"(?<![\w.+\-])[A-Za-z0-9][A-Za-z0-9._%+\-]{0,63}@"
            r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,62}[A-Za-z0-9])?"
            r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9\-]{0,62}[A-Za-z0-9])?)*\.[A-Za-z]{2,24}\b"
        ),
    ),
    "phone": Detector(
        "phone",
        _compile(
            r"(?<![\w+])(?:"
            r"\+\d{1,3}(?:[ .\-]?\(?\d{1,4}\)?){2,4}[ .\-]?\d{2,4}"  # international, with +
            r"|(?:\(\d{3}\)[ ]?|\d{3}[ .\-])\d{3}[ .\-]\d{4}"  # North American
            r")(?![\w])"
        ),
    ),
    "card": Detector("card", _compile(r"(?<![\d\-])\d(?:[ \-]?\d){12,18}(?![\d])"), _card_spans),
    "secret": Detector("secret", _compile(_SECRET)),
}
