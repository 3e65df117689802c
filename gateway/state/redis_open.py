"""A run opened against Redis in one round trip: its Idempotency-Key claim, its quota admission
and its record, by one script (design §2).

The three are the store scripts of their own modules (`policies/idempotency.py`,
`gateway/state/quotas_redis.py`, `gateway/state/run_store_redis.py`), run here as functions of
one script in the order a request takes them: a key held by another run stops there (the replay path
answers it), a refused admission gives the fresh claim back in the same step, and the record is
written only for an admitted run. So a new request costs one round trip before its run starts,
where it was one per step, and what is taken is the same as step by step.

An opening is idempotent: the client sends a command again when its reply was lost with the
connection
(`gateway/state/redis_client.py`), and the script may well have run. Each opening carries a
token of its own, kept in the run's record with the admission's reply; the same opening again
finds it and gets that reply back instead of a second claim and admission (and a "taken").

Each admission's answer (the tenant's usage after it, or a refusal) is kept in `headroom`: by it
the next run of a tenant far from its limits goes upstream before its own opening is back.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from gateway.state.quotas_redis import ADMIT, RedisQuotaStore
from gateway.state.redis_scripts import CREATE
from gateway.state.run_store import RunRecord
from gateway.state.run_store_mirrored import MirroredRunStore
from policies.headroom import Headroom
from policies.idempotency import CLAIM, Claim, RedisIdempotencyStore
from policies.quotas import Admission, QuotaRequest

# KEYS: the run hash, then the claim key (if any), then the quota keys (if any)
# ARGV: claim arg count (0: no key), admit arg count (0: no limits), the opening's token, then
# those args, then the create script's. Answers {'taken'}, {'held', stored claim},
# {'refused', admit reply...} or {'opened', admit reply...} (again for a repeat of the opening).
OPEN = (
    "local calls = {}\n"
    + "".join(
        f"calls.{name} = function(KEYS, ARGV)\n{body}\nend\n"
        for name, body in (("claim", CLAIM), ("admit", ADMIT), ("create", CREATE))
    )
    + """
local function part(from, list, count)
  local out = {}
  for j = 1, count do out[j] = list[from + j - 1] end
  return out
end
local opened = redis.call('HMGET', KEYS[1], 'opening', 'admitted')
if opened[1] == ARGV[3] then  -- a resend of this opening, which went through: its answer again
  local state = {}
  for v in string.gmatch(opened[2], '%S+') do state[#state + 1] = tonumber(v) end
  return {'opened', unpack(state)}
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'taken'} end
local nclaim, nadmit = tonumber(ARGV[1]), tonumber(ARGV[2])
local k, a = 2, 4
if nclaim > 0 then
  local held = calls.claim(part(k, KEYS, 1), part(a, ARGV, nclaim))
  if held[1] == 0 then return {'held', held[2]} end
  k, a = k + 1, a + nclaim
end
local state = {}
if nadmit > 0 then
  state = calls.admit(part(k, KEYS, 7), part(a, ARGV, nadmit))
  if state[1] ~= 1 then
    if nclaim > 0 then redis.call('DEL', KEYS[2]) end
    return {'refused', unpack(state)}
  end
  a = a + nadmit
end
calls.create({KEYS[1]}, part(a, ARGV, #ARGV - a + 1))
local kept = {}  -- NOTE: %.17g: a µs time is past the 14 digits tostring() keeps
for j = 1, #state do kept[j] = string.format('%.17g', state[j]) end
redis.call('HSET', KEYS[1], 'opening', ARGV[3], 'admitted', table.concat(kept, ' '))
return {'opened', unpack(state)}
"""
)


@dataclass(slots=True, frozen=True)
class KeyClaim:
    """What claiming an Idempotency-Key for a new run needs."""

    tenant: str
    key: str
    fingerprint: str
    run_id: str
    ttl: float


@dataclass(slots=True, frozen=True)
class Opening:
    """The run's admission (None: its tenant has no limits); or `held`, the claim of another
    run that holds the key, and then nothing was taken."""

    admission: Admission | None = None
    held: Claim | None = None


class RedisOpener:
    def __init__(
        self, keys: RedisIdempotencyStore, quotas: RedisQuotaStore, runs: MirroredRunStore
    ) -> None:
        self.keys = keys
        self.quotas = quotas
        self.runs = runs
        # what this replica last heard of each tenant's usage: whether a run may go upstream
        # before its admission is back (gateway/runs/life.py)
        self.headroom = Headroom()
        self._open = runs.shared.redis.register_script(OPEN)

    def roomy(self, quota: QuotaRequest | None) -> bool:
        """Whether the run's admission is all but sure to pass: no limits, or a tenant far from
        them by what this replica last heard (policies/headroom.py)."""
        return quota is None or self.headroom.roomy(quota)

    async def open(
        self, claim: KeyClaim | None, quota: QuotaRequest | None, record: RunRecord
    ) -> Opening:
        """Claim, admit and record the run; raises QuotaExceeded for a refused admission."""
        keys, args = self.runs.shared.create_call(record)
        token = secrets.token_hex(8)  # this opening's own: a resend of it is known by it
        claim_keys: list[str] = []
        claim_args: list[Any] = []
        if claim is not None:
            claim_keys, claim_args = self.keys.claim_call(
                claim.tenant, claim.key, claim.fingerprint, claim.run_id, claim.ttl
            )
        quota_keys: list[str] = []
        quota_args: list[Any] = []
        now = 0
        if quota is not None:
            quota_keys, quota_args, now = self.quotas.admit_call(
                quota.tenant, quota.limits, "admit", quota
            )
            self.headroom.opening(quota)
        admission = None
        try:
            reply = await self._open(
                keys=[*keys, *claim_keys, *quota_keys],
                args=[len(claim_args), len(quota_args), token, *claim_args, *quota_args, *args],
            )
            tag = reply[0]
            if tag == b"taken":
                raise ValueError(f"run {record.run_id} exists")
            if tag == b"held":
                return Opening(held=self.keys.claimed(0, reply[1]))
            if quota is not None:  # a refusal raises here
                admission = self.quotas.admission(quota, *self.quotas.reply(reply[1:], now))
        finally:
            if quota is not None:
                self.headroom.answered(quota, admission.usage if admission else None)
        await self.runs.adopt(record)
        return Opening(admission)
