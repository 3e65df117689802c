"""What the soak's clients saw: each run as its client saw it (`Seen`), and what every client
counted and found wrong (`Observed`), for the checks after the run."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

COUNTED = (  # what the clients count, shown in the table even when none happened
    "requests",
    "503s retried",
    "resumes by Last-Event-ID",
    "resumes by starting_after",
    "resumes later than the grace: cancelled",
    "cancels answered cancelled",
    "cancels answered completed",
    "streams cut before their first text",
)


@dataclass(slots=True)
class Seen:
    """One run as the soak's clients saw it."""

    run_id: str
    kind: str
    prompt: int
    expect: frozenset[str] = frozenset({"completed"})  # statuses that agree with what was seen
    text: str | None = None  # the whole text, when a stream of it was read to its finish
    resumes: int = 0
    merged: bool = False  # text chunks came merged: the client had fallen behind
    trail: list[str] = field(default_factory=list)  # each drop and resume, for a failure


class Observed:
    """What every client saw, shared by the client threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: dict[str, Seen] = {}
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTED, 0))
        self.problems: list[str] = []

    def add(self, seen: Seen) -> Seen:
        with self._lock:
            self.runs[seen.run_id] = seen
        return seen

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def problem(self, what: str) -> None:
        with self._lock:
            self.problems.append(what)
