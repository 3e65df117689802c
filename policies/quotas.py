"""Per-tenant quotas: requests and tokens per rolling minute, live runs, a token budget and a
cost budget (money at the config's prices, in NANOS) per period.

`QuotaStore.admit` checks every limit and reserves in one atomic step; `release` frees the run's
slot and corrects its token reservation to what the run really used. Two stores keep the same
contract: `MemoryQuotaStore` (one replica) and `RedisQuotaStore` (replicas sharing Redis, in
`gateway.state.quotas_redis`). Both decide with `refusal()` below over the same `Snapshot`, so a 429
reads the same whichever store answered.

Windows are exact sliding logs, not buckets: an admission at time t counts against rpm and tpm
until t + 60 s, so no 60-second span ever holds more than rpm admissions or tpm reserved tokens,
minute boundaries included. Times are integer microseconds from the caller's clock (tests drive a
fake one). A live-run slot lasts at most `LIVE_TTL` so a crashed replica's slots come back; past
it the run counts as lost: its reservation stays charged and a late release is a no-op.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

WINDOW = 60.0  # seconds: the rolling window of rpm and tpm
LIVE_TTL = 3600.0  # seconds a live-run slot survives without release; above any run deadline
CONCURRENCY_RETRY = 1.0  # seconds: nobody knows when a live run ends, so suggest a short wait
US = 1_000_000
NANOS = 1_000_000_000  # a cost budget is counted in billionths of its currency, exactly
# what a refusal names as its `limit` (sluice_quota_rejections_total{limit})
LIMITS = ("requests", "tokens", "concurrency", "budget", "budget_cost")


@dataclass(slots=True, frozen=True)
class QuotaLimits:
    """A tenant's limits; None means unlimited."""

    rpm: int | None = None  # requests in any rolling 60 s
    tpm: int | None = None  # tokens reserved in any rolling 60 s
    max_concurrent: int | None = None  # live runs
    budget_tokens: int | None = None  # tokens per budget period
    budget_period: float | None = None  # seconds; periods are aligned to the Unix epoch
    budget_cost: float | None = None  # money per budget period, at the config's [prices]


@dataclass(slots=True, frozen=True)
class QuotaRequest:
    tenant: str
    run_id: str  # unique per run: it names the run's slot and reservation
    tokens: int  # reserved: prompt estimate + requested max tokens
    limits: QuotaLimits
    cost: int = 0  # reserved against budget_cost, in NANOS: those tokens at the model's price


@dataclass(slots=True)
class Admission:
    tenant: str
    run_id: str
    reserved: int
    limits: QuotaLimits
    headers: dict[str, str]  # x-ratelimit-* after this admission
    reserved_cost: int = 0  # NANOS
    usage: Snapshot | None = None  # the tenant's usage after this admission, this run included


class QuotaExceeded(Exception):
    """A refused admission (a 429). It consumed nothing."""

    def __init__(
        self, limit: str, code: str, retry_after: float, headers: dict[str, str], message: str
    ) -> None:
        super().__init__(message)
        self.limit = limit  # one of LIMITS
        self.code = code  # "rate_limit_exceeded" | "insufficient_quota" (the budgets)
        self.retry_after = retry_after  # seconds until a retry could pass
        self.headers = headers  # x-ratelimit-* plus "retry-after"
        self.message = message


class QuotaStore(Protocol):
    async def admit(self, request: QuotaRequest) -> Admission:
        """Check every limit and reserve, atomically; raise QuotaExceeded having taken nothing."""
        ...

    async def release(self, admission: Admission, used_tokens: int, used_cost: int = 0) -> None:
        """Free the slot and set the run's tpm and budget charges to `used_tokens` and
        `used_cost` (NANOS); idempotent."""
        ...

    async def headers(self, tenant: str, limits: QuotaLimits) -> dict[str, str]:
        """The tenant's current x-ratelimit-* headers, consuming nothing."""
        ...


def estimate_prompt_tokens(messages: list[tuple[str, str]]) -> int:
    """A cheap, deliberately high estimate of a prompt's tokens from (role, text) pairs.

    BPE tokenizers average about 4 bytes of English per token, so a third of the UTF-8 bytes
    overshoots; 4 per message covers the role and chat-template framing, 3 the reply's priming
    (OpenAI's own accounting). It only sizes the reservation: release corrects it to the truth.
    """
    return 3 + sum(math.ceil(len(text.encode()) / 3) + 4 for _, text in messages)


def openai_duration(seconds: float) -> str:
    """OpenAI's reset format (Go's duration form), rounded up to the millisecond:
    "12ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    text = f"{secs}" + (f".{frac:03d}".rstrip("0") if frac else "") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def micros(seconds: float) -> int:
    return round(seconds * US)


def nanos(amount: float) -> int:
    """Money in billionths, rounded up (to the nearest first: float noise is no billionth)."""
    return math.ceil(round(amount * NANOS, 3))


def budget_period(now_us: int, limits: QuotaLimits) -> tuple[int, int] | None:
    """(period length µs, index of the current period) when a budget applies."""
    if (limits.budget_tokens is None and limits.budget_cost is None) or not limits.budget_period:
        return None
    length = micros(limits.budget_period)
    return length, now_us // length


def tracks_window(limits: QuotaLimits) -> bool:
    return limits.rpm is not None or limits.tpm is not None


@dataclass(slots=True)
class Snapshot:
    """A tenant's usage at one instant, as both stores report it."""

    now_us: int
    requests: int = 0  # admissions in the window
    tokens: int = 0  # tokens they hold
    oldest_us: int | None = None  # admission time of the oldest of them
    live: int = 0
    budget_used: int = 0  # tokens charged in the current budget period
    requests_retry_us: int | None = None  # set when refusing: until enough admissions leave
    tokens_retry_us: int | None = None  # set when refusing: until enough tokens leave
    cost_used: int = 0  # NANOS charged in the current budget period


def rate_headers(limits: QuotaLimits, snap: Snapshot) -> dict[str, str]:
    """x-ratelimit-*: a pair is left out when its limit is None."""
    reset = openai_duration(
        0.0 if snap.oldest_us is None else (snap.oldest_us + micros(WINDOW) - snap.now_us) / US
    )
    headers: dict[str, str] = {}
    for kind, limit, used in (
        ("requests", limits.rpm, snap.requests),
        ("tokens", limits.tpm, snap.tokens),
    ):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


def refusal(request: QuotaRequest, snap: Snapshot) -> QuotaExceeded | None:
    """The 429 for `request` against `snap`, or None if it fits.

    When several limits refuse, the one that can never pass wins, then the longest wait: a client
    that honours retry-after is then not refused again by one of the others.
    """
    lim, tokens = request.limits, request.tokens
    found: list[tuple[bool, float, str, str]] = []  # (impossible, retry, limit, message)
    if lim.rpm is not None and snap.requests >= lim.rpm:
        retry = _retry(snap.requests_retry_us, WINDOW)
        found.append((lim.rpm == 0, retry, "requests", f"{lim.rpm} requests per minute"))
    if lim.tpm is not None and snap.tokens + tokens > lim.tpm:
        if tokens > lim.tpm:
            what = f"{lim.tpm} tokens per minute, and this request alone reserves {tokens}"
            found.append((True, WINDOW, "tokens", what))
        else:
            what = f"{lim.tpm} tokens per minute ({snap.tokens} in use, {tokens} requested)"
            found.append((False, _retry(snap.tokens_retry_us, WINDOW), "tokens", what))
    if lim.max_concurrent is not None and snap.live >= lim.max_concurrent:
        what = f"{lim.max_concurrent} concurrent requests"
        found.append((lim.max_concurrent == 0, CONCURRENCY_RETRY, "concurrency", what))
    found += _budget_refusals(request, snap)
    if not found:
        return None
    impossible, retry, limit, what = max(found, key=lambda f: (f[0], f[1]))
    headers = rate_headers(lim, snap)
    headers["retry-after"] = str(max(1, math.ceil(round(retry, 3))))
    if limit in _BUDGETS:
        message = f"{_BUDGETS[limit]} exceeded: {what}. It resets in {openai_duration(retry)}."
        return QuotaExceeded(limit, "insufficient_quota", retry, headers, message)
    if not impossible:
        hint = f"Try again in {openai_duration(retry)}."
    else:
        hint = "It can never pass" + ("; ask for fewer tokens." if limit == "tokens" else ".")
    message = f"Rate limit reached for {limit}: {what}. {hint}"
    return QuotaExceeded(limit, "rate_limit_exceeded", retry, headers, message)


_BUDGETS = {"budget": "Token budget", "budget_cost": "Cost budget"}


def _budget_refusals(request: QuotaRequest, snap: Snapshot) -> list[tuple[bool, float, str, str]]:
    """The budgets' part of `refusal`. A cost budget spent to the last billionth refuses even
    a run whose own cost is unknown up front (a model alias's, reserved at 0)."""
    lim, tokens, cost = request.limits, request.tokens, request.cost
    period = budget_period(snap.now_us, lim)
    if period is None:
        return []
    length, index = period
    retry = ((index + 1) * length - snap.now_us) / US
    per = f"per {openai_duration(length / US)} budget period"
    found = []
    if lim.budget_tokens is not None and snap.budget_used + tokens > lim.budget_tokens:
        what = f"{lim.budget_tokens} tokens {per} ({snap.budget_used} used, {tokens} requested)"
        found.append((tokens > lim.budget_tokens, retry, "budget", what))
    budget = None if lim.budget_cost is None else nanos(lim.budget_cost)
    if budget is not None and (snap.cost_used + cost > budget or snap.cost_used >= budget):
        what = (
            f"{lim.budget_cost:g} {per} ({snap.cost_used / NANOS:.6g} spent, "
            f"{cost / NANOS:.6g} reserved for this request)"
        )
        found.append((cost > budget, retry, "budget_cost", what))
    return found


def _retry(retry_us: int | None, default: float) -> float:
    return default if retry_us is None else max(0.0, retry_us / US)


@dataclass(slots=True)
class _Tenant:
    """One tenant's usage; mirrors the Redis keys in gateway.state.quotas_redis."""

    # (admitted µs, run), oldest first; NOTE: assumes the clock does not step back
    window: deque[tuple[int, str]] = field(default_factory=deque)
    amounts: dict[str, int] = field(default_factory=dict)  # tokens held by runs in the window
    held: int = 0  # their sum
    live: dict[str, int] = field(default_factory=dict)  # run → slot expiry µs
    # run → (reserved tokens, budget period index, reserved cost) until released
    pending: dict[str, tuple[int, int | None, int]] = field(default_factory=dict)
    budget: tuple[tuple[int, int], int] | None = None  # ((length, index), tokens charged)
    cost: int = 0  # NANOS charged in the period of `budget`


class MemoryQuotaStore:
    """Quotas for a single replica: everything runs on one event loop with no await inside a
    check-and-reserve, so plain Python is atomic here. Idle tenants' state is dropped."""

    def __init__(self, clock: Callable[[], float] = time.time, *, live_ttl: float = LIVE_TTL):
        self.clock = clock
        self._live_ttl = micros(live_ttl)
        self._tenants: dict[str, _Tenant] = {}

    async def admit(self, request: QuotaRequest) -> Admission:
        lim, run = request.limits, request.run_id
        state = self._tenants.setdefault(request.tenant, _Tenant())
        snap = self._snapshot(state, lim)
        if run in state.live:  # admitted again (as a Redis store answers a resend): counted once
            return Admission(request.tenant, run, request.tokens, lim, rate_headers(lim, snap))
        if (refused := refusal(request, snap)) is not None:
            snap.requests_retry_us, snap.tokens_retry_us = self._waits(state, request, snap)
            refused = refusal(request, snap)
            self._forget_if_idle(request.tenant, state, snap.now_us)
            raise refused
        if tracks_window(lim):
            state.window.append((snap.now_us, run))
            snap.oldest_us = state.window[0][0]
            snap.requests += 1
        if lim.tpm is not None:
            state.amounts[run] = request.tokens
            state.held += request.tokens
            snap.tokens = state.held
        state.live[run] = snap.now_us + self._live_ttl
        snap.live += 1
        period = budget_period(snap.now_us, lim)
        if period is not None:
            snap.budget_used += request.tokens
            snap.cost_used += request.cost
            state.budget, state.cost = (period, snap.budget_used), snap.cost_used
        state.pending[run] = (request.tokens, period[1] if period else None, request.cost)
        headers = rate_headers(lim, snap)
        return Admission(request.tenant, run, request.tokens, lim, headers, request.cost, snap)

    async def release(self, admission: Admission, used_tokens: int, used_cost: int = 0) -> None:
        state = self._tenants.get(admission.tenant)
        if state is None:
            return
        now = micros(self.clock())
        run, used = admission.run_id, max(0, used_tokens)
        expiry = state.live.pop(run, None)
        pending = state.pending.pop(run, None)
        if expiry is None or pending is None or expiry <= now:
            return  # released already, or lost past the slot TTL
        reserved, index, reserved_cost = pending
        if run in state.amounts:
            state.held += used - state.amounts[run]
            state.amounts[run] = used
        # A run admitted in an ended period corrects nothing: that period is over.
        period = budget_period(now, admission.limits)
        current = state.budget is not None and period is not None and state.budget[0] == period
        if current and period[1] == index:
            state.budget = (period, max(0, state.budget[1] + used - reserved))
            state.cost = max(0, state.cost + max(0, used_cost) - reserved_cost)
        self._forget_if_idle(admission.tenant, state, now)

    async def headers(self, tenant: str, limits: QuotaLimits) -> dict[str, str]:
        state = self._tenants.get(tenant)
        if state is None:
            return rate_headers(limits, Snapshot(micros(self.clock())))
        snap = self._snapshot(state, limits)
        self._forget_if_idle(tenant, state, snap.now_us)
        return rate_headers(limits, snap)

    def _snapshot(self, state: _Tenant, limits: QuotaLimits) -> Snapshot:
        """Drops what left the window and expired slots, then reads the tenant's usage."""
        now = micros(self.clock())
        cutoff = now - micros(WINDOW)
        while state.window and state.window[0][0] <= cutoff:
            _, gone = state.window.popleft()
            state.held -= state.amounts.pop(gone, 0)
        for run in [run for run, expiry in state.live.items() if expiry <= now]:
            del state.live[run]
            state.pending.pop(run, None)
        period = budget_period(now, limits)
        current = state.budget is not None and state.budget[0] == period
        used, cost = (state.budget[1], state.cost) if current else (0, 0)
        oldest = state.window[0][0] if state.window else None
        snap = Snapshot(now, len(state.window), state.held, oldest, len(state.live), used)
        snap.cost_used = cost
        return snap

    def _waits(
        self, state: _Tenant, request: QuotaRequest, snap: Snapshot
    ) -> tuple[int | None, int | None]:
        """µs until enough admissions, and enough tokens, leave the window for `request`."""
        lim, window = request.limits, micros(WINDOW)
        requests = tokens = None
        if lim.rpm and snap.requests >= lim.rpm:
            requests = state.window[snap.requests - lim.rpm][0] + window - snap.now_us
        excess = snap.tokens + request.tokens - (lim.tpm or 0)
        if lim.tpm is not None and excess > 0 and request.tokens <= lim.tpm:
            for admitted, run in state.window:
                excess -= state.amounts.get(run, 0)
                if excess <= 0:
                    tokens = admitted + window - snap.now_us
                    break
        return requests, tokens

    def _forget_if_idle(self, tenant: str, state: _Tenant, now: int) -> None:
        budget_over = state.budget is None or (state.budget[0][1] + 1) * state.budget[0][0] <= now
        if not state.window and not state.live and budget_over:
            del self._tenants[tenant]
