"""A safety policy: what a tenant's streamed text must pass before it leaves the gateway.

A policy is plain data (from the tenants file's `[safety.NAME]` tables, design §5) plus its
compiled block pattern, and it builds a fresh set of checkers for each choice of a run. Its
`digest` is a hash of its content: the run record keeps name and digest, so it is always known
what policy judged a run's text, however often the file changed since.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import orjson
import regex

from safety.checkers import BlockTerms, Checker, Redactor
from safety.detectors import DETECTORS
from safety.moderation import ModerationClient, ModerationSettings, RemoteModeration

MODES = ("chars", "sentence")
REDACTION = "[REDACTED]"


class PolicyError(ValueError):
    """A policy value that cannot work; the message names the value, not the field."""


@dataclass(slots=True, frozen=True)
class SafetyPolicy:
    name: str
    mode: str = "chars"  # "chars": W characters behind the front; "sentence": at sentence ends
    window_chars: int = 32
    block_terms: tuple[str, ...] = ()  # case-insensitive; "/…/" is a regex
    redact: tuple[str, ...] = ()  # names of DETECTORS
    moderation: ModerationSettings | None = None
    digest: str = field(default="", compare=False)
    block_pattern: regex.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, name: str, **values: object) -> SafetyPolicy:
        """A checked policy with its block pattern compiled and its digest taken; raises
        PolicyError."""
        policy = cls(name, **values)
        if policy.mode not in MODES:
            raise PolicyError(f"mode must be one of {', '.join(MODES)}, got {policy.mode!r}")
        if policy.window_chars < 0:
            raise PolicyError(f"window_chars must be at least 0, got {policy.window_chars}")
        for detector in policy.redact:
            if detector not in DETECTORS:
                raise PolicyError(
                    f"unknown detector {detector!r} (known: {', '.join(sorted(DETECTORS))})"
                )
        content = {
            "mode": policy.mode,
            "window_chars": policy.window_chars,
            "block_terms": policy.block_terms,
            "redact": policy.redact,
            "moderation": None if policy.moderation is None else asdict(policy.moderation),
        }
        digest = hashlib.sha256(orjson.dumps(content, option=orjson.OPT_SORT_KEYS)).hexdigest()
        pattern = compile_terms(policy.block_terms) if policy.block_terms else None
        object.__setattr__(policy, "digest", digest)
        object.__setattr__(policy, "block_pattern", pattern)
        return policy

    @property
    def label(self) -> str:
        """`name@digest12`: how the run record and the run-end line name the policy."""
        return f"{self.name}@{self.digest[:12]}"

    def checkers(self, moderation: ModerationClient | None) -> list[Checker]:
        """A fresh set for one choice (the remote checker keeps state per choice)."""
        return [checker for build in CHECKERS for checker in build(self, moderation)]


def _block_terms(policy: SafetyPolicy, _: ModerationClient | None) -> list[Checker]:
    return [] if policy.block_pattern is None else [BlockTerms(policy.block_pattern)]


def _redactors(policy: SafetyPolicy, _: ModerationClient | None) -> list[Checker]:
    return [Redactor(name) for name in policy.redact]


def _remote_moderation(policy: SafetyPolicy, client: ModerationClient | None) -> list[Checker]:
    if policy.moderation is None or client is None:
        return []
    return [RemoteModeration(client, policy.moderation, policy.window_chars)]


# What builds a policy's checkers for one choice, in the order they are asked. A new checker is
# one class (safety/checkers.py) and one entry here that reads its settings from the policy.
CheckerBuilder = Callable[[SafetyPolicy, ModerationClient | None], list[Checker]]
CHECKERS: list[CheckerBuilder] = [_block_terms, _redactors, _remote_moderation]


def compile_terms(terms: tuple[str, ...]) -> regex.Pattern[str]:
    """One case-insensitive pattern for every term: a literal, or a regex written `/…/`."""
    parts = []
    for term in terms:
        if len(term) >= 2 and term.startswith("/") and term.endswith("/"):
            source = term[1:-1]
            try:
                regex.compile(source, regex.VERSION1)
            except regex.error as exc:
                raise PolicyError(f"{term!r} is not a valid regex: {exc}") from None
            if regex.fullmatch(source, "", flags=regex.VERSION1 | regex.IGNORECASE):
                raise PolicyError(f"{term!r} matches the empty text, so it would block everything")
        else:
            source = regex.escape(term)
        parts.append(f"(?:{source})")
    return regex.compile("|".join(parts), regex.VERSION1 | regex.IGNORECASE)
