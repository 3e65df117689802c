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


def _card_ok(span: str) -> bool:
    digits = "".join(ch for ch in span if ch.isdigit())
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


@dataclass(slots=True, frozen=True)
class Detector:
    name: str
    pattern: regex.Pattern[str]
    valid: Callable[[str], bool] | None = None  # None: every match counts


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
        # a PEM block, header to footer (a base64 body cannot run past its footer); a header
        # alone, the key still streaming, is held
        r"-----BEGIN [A-Z0-9 ]{1,40}-----[A-Za-z0-9+/=\s]{0,8192}-----END [A-Z0-9 ]{1,40}-----",
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
    "card": Detector("card", _compile(r"(?<![\d\-])\d(?:[ \-]?\d){12,18}(?![\d])"), _card_ok),
    "secret": Detector("secret", _compile(_SECRET)),
}
