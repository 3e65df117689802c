"""Idempotency keys, Stripe's model scoped by tenant (design §5).

The first request with a key claims it for the run it is about to create; a repeat finds the
stored claim and compares body fingerprints (same body: the same run; a different body: 422
`idempotency_key_reused`). Claims are atomic per (tenant, key), across replicas in Redis, and
expire after a TTL. A first attempt that fails before its run exists releases its claim so a
retry can try again; the release is conditional, so it never drops a claim someone else holds.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis

MAX_KEY_LEN = 255


def validate_key(raw: str) -> str:
    """The key as given, if it is 1 to 255 printable ASCII characters (0x20 to 0x7E)."""
    if not raw:
        raise ValueError("Idempotency-Key is empty")
    if len(raw) > MAX_KEY_LEN:
        raise ValueError(f"Idempotency-Key is {len(raw)} characters; at most {MAX_KEY_LEN}")
    for i, ch in enumerate(raw):
        if not " " <= ch <= "~":
            raise ValueError(
                f"Idempotency-Key has a character outside printable ASCII at position {i}"
            )
    return raw


def body_fingerprint(body: object) -> str:
    """A digest of the parsed body: key order and whitespace of the original do not matter."""
    return "sha256:" + hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(slots=True, frozen=True)
class Claim:
    run_id: str
    fingerprint: str
    created: float
    fresh: bool  # True: this call created it; False: it already existed
    answer: bytes | None = None  # the run's ending (JSON), once remembered (it outlives the run)


class IdempotencyStore(Protocol):
    async def claim(
        self, tenant: str, key: str, fingerprint: str, run_id: str, ttl: float
    ) -> Claim:
        """Atomically: the first caller for (tenant, key) stores `run_id` and gets fresh=True;
        everyone after gets the stored claim (fresh=False) until it expires."""
        ...

    async def release(self, tenant: str, key: str, run_id: str) -> None:
        """Forget the claim, only if it still maps to `run_id`."""
        ...

    async def remember(self, tenant: str, key: str, run_id: str, answer: bytes) -> None:
        """Keep the run's ending (its JSON) with its claim (same expiry), if it still maps to
        `run_id`: repeats after the run itself is gone are answered from it."""
        ...


def _check_ttl(ttl: float) -> None:
    if not ttl > 0:
        raise ValueError(f"idempotency ttl must be positive, got {ttl!r}")


@dataclass(slots=True)
class _Entry:
    claim: Claim
    expires: float


class MemoryIdempotencyStore:
    """One replica's claims. Each claim is checked and stored without an await in between, so
    concurrent tasks see one winner; expired claims are dropped as new ones arrive.

    The endings kept with claims are bounded by `max_answer_bytes`: past it the oldest ending is
    dropped (its claim stays, so a repeat is still recognised, and told the run is gone)."""

    def __init__(
        self, clock: Callable[[], float] = time.time, max_answer_bytes: int = 256 << 20
    ) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}
        # NOTE: TTLs may differ per call, so expiry is not insertion order; a heap of
        # (expires, scope) finds the expired ones. Heap entries left by a release and re-claim
        # are stale: they are popped in their turn and drop nothing, as the live entry expires
        # later. The heap holds at most the claims made within one TTL.
        self._expiry: list[tuple[float, tuple[str, str]]] = []
        self.max_answer_bytes = max_answer_bytes
        self._answers: OrderedDict[tuple[str, str], int] = OrderedDict()  # oldest first: bytes
        self.answer_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _sweep(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, scope = heapq.heappop(self._expiry)
            entry = self._entries.get(scope)
            if entry is not None and entry.expires <= now:
                self._drop(scope)

    def _drop(self, scope: tuple[str, str]) -> None:
        del self._entries[scope]
        self.answer_bytes -= self._answers.pop(scope, 0)

    async def claim(
        self, tenant: str, key: str, fingerprint: str, run_id: str, ttl: float
    ) -> Claim:
        _check_ttl(ttl)
        now = self._clock()
        self._sweep(now)
        scope = (tenant, key)
        entry = self._entries.get(scope)
        if entry is not None and entry.expires > now:
            c = entry.claim
            return Claim(c.run_id, c.fingerprint, c.created, fresh=False, answer=c.answer)
        claim = Claim(run_id, fingerprint, now, fresh=True)
        if entry is not None:
            self._drop(scope)
        self._entries[scope] = _Entry(claim, now + ttl)
        heapq.heappush(self._expiry, (now + ttl, scope))
        return claim

    async def release(self, tenant: str, key: str, run_id: str) -> None:
        entry = self._entries.get((tenant, key))
        if entry is not None and entry.claim.run_id == run_id:
            self._drop((tenant, key))

    async def remember(self, tenant: str, key: str, run_id: str, answer: bytes) -> None:
        scope = (tenant, key)
        entry = self._entries.get(scope)
        if entry is None or entry.claim.run_id != run_id:
            return
        c = entry.claim
        entry.claim = Claim(c.run_id, c.fingerprint, c.created, c.fresh, answer)
        self.answer_bytes += len(answer) - self._answers.pop(scope, 0)
        self._answers[scope] = len(answer)
        while self.answer_bytes > self.max_answer_bytes and self._answers:
            oldest, size = self._answers.popitem(last=False)
            self.answer_bytes -= size
            kept = self._entries[oldest].claim
            self._entries[oldest].claim = Claim(
                kept.run_id, kept.fingerprint, kept.created, kept.fresh, None
            )


# KEYS: claim key; ARGV: claim json, ttl ms. Returns {1, json} when stored, {0, stored json}.
CLAIM = """
local stored = redis.call('GET', KEYS[1])
if stored then return {0, stored} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, ARGV[1]}
"""

# KEYS: claim key; ARGV: run id. Deletes only a claim that still maps to that run.
_RELEASE = """
local stored = redis.call('GET', KEYS[1])
if stored and cjson.decode(stored)['run_id'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# KEYS: claim key; ARGV: run id, answer json. Keeps the claim's expiry. The answer stays a JSON
# string inside the claim: cjson would turn its empty lists into objects.
_REMEMBER = """
local stored = redis.call('GET', KEYS[1])
if not stored then return 0 end
local claim = cjson.decode(stored)
if claim['run_id'] ~= ARGV[1] then return 0 end
claim['answer'] = ARGV[2]
redis.call('SET', KEYS[1], cjson.encode(claim), 'KEEPTTL')
return 1
"""


class RedisIdempotencyStore:
    """Claims shared by replicas: a JSON value per (tenant, key) with a PX expiry.

    The claim is one script (GET, else SET PX), so a claim that expires between a failed
    SET NX and the GET that would follow cannot leave a caller with nothing.
    """

    def __init__(self, redis: Redis, prefix: str = "sluice:") -> None:
        self.redis = redis
        self.prefix = prefix
        self._claim = redis.register_script(CLAIM)
        self._release = redis.register_script(_RELEASE)
        self._remember = redis.register_script(_REMEMBER)

    def _key(self, tenant: str, key: str) -> str:
        # NOTE: the client's key is hashed: Redis keys stay short and free of user text, and the
        # fixed-length hex tail keeps a tenant name with ':' from colliding with another scope.
        return f"{self.prefix}idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"

    async def claim(
        self, tenant: str, key: str, fingerprint: str, run_id: str, ttl: float
    ) -> Claim:
        keys, args = self.claim_call(tenant, key, fingerprint, run_id, ttl)
        return self.claimed(*await self._claim(keys=keys, args=args))

    def claim_call(
        self, tenant: str, key: str, fingerprint: str, run_id: str, ttl: float
    ) -> tuple[list[str], list[Any]]:
        """The claim script's keys and args: it also runs as part of a larger one
        (gateway/state/redis_open.py)."""
        _check_ttl(ttl)
        value = orjson.dumps({"run_id": run_id, "fingerprint": fingerprint, "created": time.time()})
        return [self._key(tenant, key)], [value, max(1, round(ttl * 1000))]

    @staticmethod
    def claimed(fresh: int, stored: bytes) -> Claim:
        """The claim script's reply as a Claim."""
        d = orjson.loads(stored)
        answer = d["answer"].encode() if "answer" in d else None
        return Claim(d["run_id"], d["fingerprint"], d["created"], fresh=fresh == 1, answer=answer)

    async def release(self, tenant: str, key: str, run_id: str) -> None:
        await self._release(keys=[self._key(tenant, key)], args=[run_id])

    async def remember(self, tenant: str, key: str, run_id: str, answer: bytes) -> None:
        await self._remember(keys=[self._key(tenant, key)], args=[run_id, answer])
