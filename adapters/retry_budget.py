"""The gateway's retry budget (design §6): retries are at most a share of requests, so a failing
backend is not hammered by its own clients' retries.

Every request a pool is asked for is `requested()`; every retry, a request that failed before its
first event sent to another member (or, for a model alias, to its next target), first asks
`allow(reason)`. Over the last `window` seconds, retries may be at most `ratio` of requests, and
never fewer than `min_retries` (a gateway with little traffic can still retry: Finagle's
`minRetriesPerSec`, Envoy's `min_retry_concurrency`); a ratio of 0 turns retries off. A refused
retry is counted under `budget_exhausted` and the request fails as it would have with no other
member to go to, with its own error. Upstream attempts are so at most (1 + ratio) * requests,
plus the minimum, however many members a request could try.

Attempts are spaced by `backoff(n)`: a jittered exponential step (25 ms, doubling, at most 1 s),
half of it fixed and half at random. A member that answered 429 or 503 with `retry-after` is
skipped until then (adapters/pool_members.py); that is not a wait, the retry goes elsewhere.

One budget per gateway process, shared by all its pools (gateway/app.py owns it); the clock and
the random source are injected.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Callable

from adapters.base import BackendUnavailable

# why a retry was made: the member was unavailable (unreachable, a 503, busy), rate limited (a
# 429), or failed (a 5xx, a broken or malformed stream, taken out before its first event); or
# the alias layer fell back to its next target
RETRY_REASONS = ("unavailable", "rate_limited", "failed", "fallback")
REFUSED = "budget_exhausted"  # a retry the budget refused (counted beside the reasons)
MIN_RETRIES = 10  # per window, whatever the traffic: enough for a breaker to open (5 in a row)
BACKOFF_BASE = 0.025  # seconds before the first retry, at most
BACKOFF_CAP = 1.0


def retry_reason(exc: BaseException) -> str:
    """The reason to count a retry after `exc` under."""
    if isinstance(exc, BackendUnavailable):
        return "rate_limited" if exc.status == 429 else "unavailable"
    return "failed"


class RetryBudget:
    def __init__(
        self,
        ratio: float = 0.2,
        *,
        window: float = 10.0,
        min_retries: int = MIN_RETRIES,
        backoff_base: float = BACKOFF_BASE,
        backoff_cap: float = BACKOFF_CAP,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if ratio < 0 or window <= 0 or min_retries < 0:
            raise ValueError("a retry budget's ratio and minimum are >= 0, its window > 0")
        self.ratio = ratio
        self.window = window
        self.min_retries = min_retries if ratio > 0 else 0
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.clock = clock
        self.counts: Counter[str] = Counter()  # reason (or REFUSED) → retries
        self._rng = rng or random.Random()
        self._requests: deque[float] = deque()  # when, in the window
        self._retries: deque[float] = deque()
        self._keys: dict[str, float] = {}  # request keys counted in the window, oldest first

    def requested(self, key: str | None = None) -> None:
        """A request was made. `key` (its request id): counted once per window however many
        pools it reaches, so a fallback to another target is a retry, not a new request."""
        now = self.clock()
        self._forget(now)
        if key is not None:
            if key in self._keys:
                return
            self._keys[key] = now
        self._requests.append(now)

    def allow(self, reason: str) -> bool:
        """Whether a retry may be made now; counted under `reason` if so, else as refused."""
        now = self.clock()
        self._forget(now)
        if len(self._retries) + 1 > max(self.min_retries, self.ratio * len(self._requests)):
            self.counts[REFUSED] += 1
            return False
        self._retries.append(now)
        self.counts[reason] += 1
        return True

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt` (1: the first): half of the step
        `backoff_base` * 2^(attempt - 1), at most `backoff_cap`, plus up to as much again."""
        step = min(self.backoff_cap, self.backoff_base * 2 ** max(0, attempt - 1))
        return step / 2 * (1 + self._rng.random())

    def _forget(self, now: float) -> None:
        horizon = now - self.window
        for times in (self._requests, self._retries):
            while times and times[0] <= horizon:
                times.popleft()
        keys = self._keys
        while keys:
            oldest = next(iter(keys))
            if keys[oldest] > horizon:
                break
            del keys[oldest]
