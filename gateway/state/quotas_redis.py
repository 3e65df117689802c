"""The Redis quota store, shared by gateway replicas: one Lua script admits, one releases.

Each script reads, decides and writes in one step, so replicas racing for the last slot can never
both win (no read-modify-write from Python). Keys per tenant share a `{tenant}` hash tag, so a
cluster keeps them on one slot:

    window   ZSET  run → admission time (µs); the rolling-minute log behind rpm and tpm
    amounts  HASH  run → tokens it holds in that window; `held` STRING is their sum
    live     ZSET  run → slot expiry (µs); concurrency, and which runs still await release
    pending  HASH  run → "reserved period-index", what release needs to correct the charge
    budget:<period µs>:<index>  STRING  tokens charged in that budget period
    cost:<period µs>:<index>    STRING  money charged in it (NANOS), against budget_cost

The window keys expire a minute after the tenant's last admission, live and pending `LIVE_TTL`
after it, a budget counter when its period ends: an idle tenant leaves nothing behind. Time comes
from the caller's clock (passed in as integer µs, precomputed in Python so Lua never formats a
large number), never from Redis TIME, so tests can drive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from policies.quotas import (
    LIVE_TTL,
    WINDOW,
    Admission,
    QuotaLimits,
    QuotaRequest,
    Snapshot,
    budget_period,
    micros,
    nanos,
    rate_headers,
    refusal,
)

_KEYS = (
    "local W, A, H, L, P, B, C = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]\n"
)

# ARGV: 1 mode ("admit" | "peek"), 2 now, 3 run, 4 tokens, 5 rpm, 6 tpm, 7 max_concurrent,
#       8 budget tokens (-1 = unlimited), 9 window cutoff (now - window), 10 window µs,
#       11 slot expiry, 12 window ttl ms, 13 live ttl ms, 14 budget ttl ms, 15 period index,
#       16 cost budget (NANOS; -1 = unlimited), 17 cost reserved (NANOS)
# Returns {status (1 admitted, also again for a live run; 0 refused or peek), requests, tokens held,
#          oldest admission (-1: none), live, budget used, requests retry µs, tokens retry µs,
#          cost used}
ADMIT = (
    _KEYS
    + """
local mode, now, run = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local tokens, rpm, tpm = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local maxc, budget, window = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[10])
local cbudget, cost = tonumber(ARGV[16]), tonumber(ARGV[17])

-- NOTE: drop in batches: unpack() is bounded by Lua's stack.
while true do
  local gone = redis.call('ZRANGEBYSCORE', W, '-inf', ARGV[9], 'LIMIT', 0, 500)
  if #gone == 0 then break end
  local freed = 0
  for _, amount in ipairs(redis.call('HMGET', A, unpack(gone))) do
    freed = freed + (tonumber(amount) or 0)
  end
  redis.call('HDEL', A, unpack(gone))
  redis.call('ZREM', W, unpack(gone))
  if freed > 0 and redis.call('EXISTS', H) == 1 then redis.call('DECRBY', H, freed) end
end
while true do
  local lost = redis.call('ZRANGEBYSCORE', L, '-inf', ARGV[2], 'LIMIT', 0, 500)
  if #lost == 0 then break end
  redis.call('HDEL', P, unpack(lost))
  redis.call('ZREM', L, unpack(lost))
end

local count = redis.call('ZCARD', W)
if count == 0 then redis.call('DEL', A, H) end
local held = tonumber(redis.call('GET', H) or '0')
local live = redis.call('ZCARD', L)
local used = 0
if budget >= 0 then used = tonumber(redis.call('GET', B) or '0') end
local spent = 0
if cbudget >= 0 then spent = tonumber(redis.call('GET', C) or '0') end
local function oldest()
  local first = redis.call('ZRANGE', W, 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return tonumber(first[2])
end
local function state(status, req_retry, tok_retry)
  return {status, count, held, oldest(), live, used, req_retry, tok_retry, spent}
end
if mode == 'peek' then return state(0, -1, -1) end
-- NOTE: a live run admitted again is the client's resend of an admission whose reply was
-- lost (run ids are never reused): it was admitted, and is not counted twice.
if redis.call('ZSCORE', L, run) then return state(1, -1, -1) end

local ok, req_retry, tok_retry = true, -1, -1
if rpm >= 0 and count >= rpm then
  ok = false
  if rpm > 0 then
    local entry = redis.call('ZRANGE', W, count - rpm, count - rpm, 'WITHSCORES')
    req_retry = tonumber(entry[2]) + window - now
  end
end
if tpm >= 0 and held + tokens > tpm then
  ok = false
  local excess, start = held + tokens - tpm, 0
  while tokens <= tpm and tok_retry < 0 do
    local batch = redis.call('ZRANGE', W, start, start + 499, 'WITHSCORES')
    if #batch == 0 then break end
    local runs = {}
    for i = 1, #batch, 2 do runs[#runs + 1] = batch[i] end
    for i, amount in ipairs(redis.call('HMGET', A, unpack(runs))) do
      excess = excess - (tonumber(amount) or 0)
      if excess <= 0 then
        tok_retry = tonumber(batch[2 * i]) + window - now
        break
      end
    end
    start = start + 500
  end
end
if maxc >= 0 and live >= maxc then ok = false end
if budget >= 0 and used + tokens > budget then ok = false end
if cbudget >= 0 and (spent + cost > cbudget or spent >= cbudget) then ok = false end
if not ok then return state(0, req_retry, tok_retry) end

if rpm >= 0 or tpm >= 0 then
  redis.call('ZADD', W, ARGV[2], run)
  count = count + 1
  if tpm >= 0 then
    redis.call('HSET', A, run, ARGV[4])
    held = redis.call('INCRBY', H, ARGV[4])
  end
  -- NOTE: the three window keys always share one expiry, so they vanish together.
  redis.call('PEXPIRE', W, ARGV[12])
  redis.call('PEXPIRE', A, ARGV[12])
  redis.call('PEXPIRE', H, ARGV[12])
end
redis.call('ZADD', L, ARGV[11], run)
redis.call('PEXPIRE', L, ARGV[13])
live = live + 1
local period = '-1'
if budget >= 0 then
  used = redis.call('INCRBY', B, ARGV[4])
  redis.call('PEXPIRE', B, ARGV[14])
  period = ARGV[15]
end
if cbudget >= 0 then
  spent = redis.call('INCRBY', C, ARGV[17])
  redis.call('PEXPIRE', C, ARGV[14])
  period = ARGV[15]
end
redis.call('HSET', P, run, ARGV[4] .. ' ' .. period .. ' ' .. ARGV[17])
redis.call('PEXPIRE', P, ARGV[13])
return state(1, -1, -1)
"""
)

# ARGV: 1 run, 2 used tokens, 3 now, 4 current budget period index (-1: no budget),
#       5 used cost (NANOS)
# Returns 1 if this call released the run, 0 if it was released already or lost past its TTL.
_RELEASE = (
    _KEYS
    + """
local run, used = ARGV[1], tonumber(ARGV[2])
local expiry = redis.call('ZSCORE', L, run)
local record = redis.call('HGET', P, run)
redis.call('ZREM', L, run)
redis.call('HDEL', P, run)
if not expiry or not record or tonumber(expiry) <= tonumber(ARGV[3]) then return 0 end
local old = redis.call('HGET', A, run)
if old then
  redis.call('HSET', A, run, ARGV[2])
  if redis.call('EXISTS', H) == 1 then redis.call('INCRBY', H, used - tonumber(old)) end
end
local reserved, period, rcost = string.match(record, '^(%d+) (%-?%d+) ?(%d*)$')
if period ~= '-1' and period == ARGV[4] and redis.call('EXISTS', B) == 1 then
  local charged = redis.call('INCRBY', B, used - tonumber(reserved))
  if charged < 0 then redis.call('INCRBY', B, -charged) end
end
if period ~= '-1' and period == ARGV[4] and redis.call('EXISTS', C) == 1 then
  local charged = redis.call('INCRBY', C, tonumber(ARGV[5]) - (tonumber(rcost) or 0))
  if charged < 0 then redis.call('INCRBY', C, -charged) end
end
return 1
"""
)


class RedisQuotaStore:
    """Quotas shared by every replica on the same Redis and prefix; limits hold exactly."""

    def __init__(
        self,
        redis: Redis,
        prefix: str = "sluice:",
        clock: Callable[[], float] = time.time,
        *,
        live_ttl: float = LIVE_TTL,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._live_ttl = micros(live_ttl)
        self._admit = redis.register_script(ADMIT)
        self._release = redis.register_script(_RELEASE)

    def _keys(self, tenant: str, period: tuple[int, int] | None) -> list[str]:
        base = f"{self.prefix}quota:{{{tenant}}}:"
        budget = f"budget:{period[0]}:{period[1]}" if period else "budget:none"
        cost = f"cost:{period[0]}:{period[1]}" if period else "cost:none"
        names = ("window", "amounts", "held", "live", "pending", budget, cost)
        return [base + name for name in names]

    async def admit(self, request: QuotaRequest) -> Admission:
        snap, status = await self._run(request.tenant, request.limits, "admit", request)
        return self.admission(request, snap, status)

    def admission(self, request: QuotaRequest, snap: Snapshot, status: int) -> Admission:
        """The admit script's answer as an Admission; raises the refusal (QuotaExceeded)."""
        if status == 0:
            refused = refusal(request, snap)
            assert refused is not None, "the admit script and refusal() disagree"
            raise refused
        return Admission(
            request.tenant,
            request.run_id,
            request.tokens,
            request.limits,
            rate_headers(request.limits, snap),
            request.cost,
            snap,
        )

    async def release(self, admission: Admission, used_tokens: int, used_cost: int = 0) -> None:
        now = micros(self.clock())
        period = budget_period(now, admission.limits)
        index = period[1] if period else -1
        args = [admission.run_id, max(0, used_tokens), now, index, max(0, used_cost)]
        await self._release(keys=self._keys(admission.tenant, period), args=args)

    async def headers(self, tenant: str, limits: QuotaLimits) -> dict[str, str]:
        snap, _ = await self._run(tenant, limits, "peek", None)
        return rate_headers(limits, snap)

    async def _run(
        self, tenant: str, limits: QuotaLimits, mode: str, request: QuotaRequest | None
    ) -> tuple[Snapshot, int]:
        keys, args, now = self.admit_call(tenant, limits, mode, request)
        return self.reply(await self._admit(keys=keys, args=args), now)

    def admit_call(
        self, tenant: str, limits: QuotaLimits, mode: str, request: QuotaRequest | None
    ) -> tuple[list[str], list[Any], int]:
        """The admit script's keys and args, and the time (µs) they were taken at: the script
        also runs as part of a larger one (gateway/state/redis_open.py)."""
        now = micros(self.clock())
        window = micros(WINDOW)
        period = budget_period(now, limits)
        budget_ms = 1 + ((period[1] + 1) * period[0] - now) // 1000 if period else 0

        def limit(value: int | None) -> int:
            return -1 if value is None else value

        args = [
            mode,
            now,
            request.run_id if request else "",
            request.tokens if request else 0,
            limit(limits.rpm),
            limit(limits.tpm),
            limit(limits.max_concurrent),
            limit(limits.budget_tokens) if period else -1,
            now - window,
            window,
            now + self._live_ttl,
            window // 1000 + 1000,
            self._live_ttl // 1000 + 1000,
            budget_ms,
            period[1] if period else -1,
            nanos(limits.budget_cost) if period and limits.budget_cost is not None else -1,
            request.cost if request else 0,
        ]
        return self._keys(tenant, period), args, now

    @staticmethod
    def reply(reply: list[Any], now: int) -> tuple[Snapshot, int]:
        """The admit script's reply: the tenant's snapshot and the status."""
        if reply[0] == -1:
            return Snapshot(now), -1
        values = [int(v) for v in reply]
        status, requests, held, oldest, live, used, req_retry, tok_retry = values[:8]
        snap = Snapshot(
            now,
            requests,
            held,
            None if oldest < 0 else oldest,
            live,
            used,
            None if req_retry < 0 else req_retry,
            None if tok_retry < 0 else tok_retry,
            values[8] if len(values) > 8 else 0,  # NOTE: an opening a prior version recorded
        )
        return snap, status
