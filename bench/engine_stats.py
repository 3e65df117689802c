"""What one request's timeline says, and a cell's summary of them: throughput, TTFT, ITL, goodput.

tok/s      output tokens generated / wall time of the timed requests (prefill included)
goodput    output tokens of requests that completed / the same wall time: a cancelled or
           timed-out request's tokens were work the client never used in full
TTFT       the request's arrival (its wave's submission) -> its first token
ITL        gap between a request's consecutive token deliveries (a delivery of k tokens
           counts k times, gap / k)
generated  tokens the row reported generating (finish events for the engine: a cancelled
           request's tokens up to its abort, tail included)
sent       tokens delivered to the client (text events) before it went away
committed  tokens of requests that completed (finish reason stop or length)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("completed", "cancelled", "timed_out")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class Trace:
    """One request's timeline: when it arrived and when its tokens arrived."""

    submitted: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    tokens: int = 0  # output tokens as counted by the row's own completion report
    error: str | None = None
    outcome: str = "completed"  # or the client's: cancelled, timed_out

    def ttft(self) -> float | None:
        return self.deliveries[0][0] - self.submitted if self.deliveries else None

    def itls(self) -> list[float]:
        gaps = []
        for (t0, _), (t1, k) in zip(self.deliveries, self.deliveries[1:], strict=False):
            gaps.extend([(t1 - t0) / k] * k)
        return gaps

    @property
    def sent(self) -> int:
        return sum(k for _, k in self.deliveries)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def summarize(traces: list[Trace], wall: float, expected: int) -> dict[str, Any]:
    """A cell's numbers; `expected` is the token count every completed request must report."""
    ttfts = [t for t in (tr.ttft() for tr in traces) if t is not None]
    itls = [g for tr in traces for g in tr.itls()]
    completed = [tr for tr in traces if tr.outcome == "completed"]
    counts = sorted({tr.tokens for tr in completed})
    errors = [tr.error for tr in traces if tr.error]
    generated = sum(tr.tokens for tr in traces)
    committed = sum(tr.tokens for tr in completed)
    return {
        "requests": len(traces),
        "tokens": generated,
        "tok_s": generated / wall if wall > 0 else 0.0,
        "goodput_tok_s": committed / wall if wall > 0 else 0.0,
        "generated": generated,
        "sent": sum(tr.sent for tr in traces),
        "committed": committed,
        "outcomes": {name: sum(tr.outcome == name for tr in traces) for name in OUTCOMES},
        "ttft_p50": _ms(percentile(ttfts, 50)),
        "ttft_p99": _ms(percentile(ttfts, 99)),
        "itl_p50": _ms(percentile(itls, 50)),
        "itl_p99": _ms(percentile(itls, 99)),
        "counts_ok": counts in ([expected], []) and not errors,
        "counts": counts,
        "errors": errors[:3],
    }
