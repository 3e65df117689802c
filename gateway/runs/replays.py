"""Idempotency keys (Stripe's model, design §5): a repeat of a request with the same key and
body gets the run the first one started; the same key with another body is refused.

The claim is taken before the run is created, with the run id the request will use, so two
identical requests racing each other create exactly one run: the loser waits the moment it
takes the winner to create it, then follows it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from gateway.app_keys import IDEMPOTENCY, METRICS, RUNS, SETTINGS
from gateway.http.errors import APIError, invalid_request
from gateway.state.run_store import TerminalRecord, UnknownRun, terminal_from_json, terminal_to_json
from policies.idempotency import body_fingerprint, validate_key

HEADER = "Idempotency-Key"
REPLAYED = {"idempotent-replayed": "true"}
_WAIT_FOR_RUN = 5.0  # seconds a repeat waits for the first request to create its run


def idempotency_key(request: web.Request) -> str | None:
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    try:
        return validate_key(raw)
    except ValueError as exc:
        raise invalid_request(HEADER, f"{HEADER}: {exc}", code="invalid_idempotency_key") from None


@dataclass(slots=True, frozen=True)
class Replay:
    """The run a repeated request gets; `answer` when the run itself is no longer kept."""

    run_id: str
    answer: TerminalRecord | None = None


async def claim(
    request: web.Request, tenant: str, key: str, body: object, run_id: str
) -> Replay | None:
    """None when this request holds the key (it starts `run_id`); otherwise what to replay.
    Raises the 422 for a key reused with another body."""
    store, runs = request.app[IDEMPOTENCY], request.app[RUNS]
    fingerprint = body_fingerprint(body)
    ttl = request.app[SETTINGS].idempotency_ttl
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _WAIT_FOR_RUN
    while True:
        held = await store.claim(tenant, key, fingerprint, run_id, ttl)
        if held.fresh:
            return None
        if held.fingerprint != fingerprint:
            raise APIError(
                422,
                f"This {HEADER} was used with a different request body; use a new key.",
                param=HEADER,
                code="idempotency_key_reused",
            )
        answer = None
        try:
            await runs.get(held.run_id)
        except UnknownRun:
            if held.answer is not None:  # ended and gone: answer as it answered
                answer = terminal_from_json(held.answer)
            elif loop.time() > deadline or time.time() - held.created > _WAIT_FOR_RUN:
                raise idempotent_run_gone(held.run_id) from None
            else:
                await asyncio.sleep(0.02)  # being created, or its first try failed: claim again
                continue
        request.app[METRICS].idempotent_replays.inc()
        return Replay(held.run_id, answer)


async def remember(
    app: web.Application, tenant: str, key: str, run_id: str, record: TerminalRecord
) -> None:
    """Settlement: keep the run's ending with its key, for repeats after the run is gone."""
    await app[IDEMPOTENCY].remember(tenant, key, run_id, terminal_to_json(record))


async def release(request: web.Request, tenant: str, key: str, run_id: str) -> None:
    """The request that held the key failed before its run began: let a retry try again."""
    await request.app[IDEMPOTENCY].release(tenant, key, run_id)


def idempotent_run_gone(run_id: str, what: str = "run") -> APIError:
    """410: the run an Idempotency-Key started has left the store; a repeat cannot replay it."""
    return APIError(
        410,
        f"The {what} this {HEADER} started ('{run_id}') is no longer retained.",
        param=HEADER,
        code="idempotent_run_expired",
    )
