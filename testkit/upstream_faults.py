"""Faults for the scripted upstream (testkit/scripted_upstream.py): what a broken
OpenAI-compatible server does, injected at random, and an outage on demand.

A `Faults` draws, for a `rate` share of streamed chat requests (seeded, so a run's sequence of
faults can be replayed), one kind uniformly from `kinds`:

- `refuse`: the connection is closed before any answer;
- `500`: an error body with status 500; `429`: the same with status 429 and `retry-after: 1`;
- `cut`: a few content chunks, then the connection is closed (after `cut_pause_s`: an HTTP
  client drops what it has buffered when the connection breaks, and the tokens sent are meant to
  reach its reader, as a server's last writes mostly do);
- `stall_before`: no first token for `stall_s`, then the stream as usual;
- `stall_after`: a few content chunks, then nothing for `stall_s` (connection kept open), then
  the rest;
- `malformed`: a few content chunks, then one that is not JSON, and the body ends;
- `no_done`: a few content chunks, then the body ends: no finish, no usage, no `[DONE]`.

"A few" is 1 to 4, drawn too, and always short of the whole answer. An `Outage` makes the
server answer nothing for a while, as a server that went down: streams in flight are cut at
their next write, every request's connection is closed (`close`), and, when it runs standalone,
its listening socket is closed too so new connections are refused (`refuse`).
`ChaosStats` counts what the server did, so a test or bench can hold the gateway's ledger
against it: tokens count when written, and a stream cut short counts only what it wrote.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

FAULT_KINDS = (
    "refuse",
    "500",
    "429",
    "cut",
    "stall_before",
    "stall_after",
    "malformed",
    "no_done",
)
ANSWERED = ("refuse", "500", "429")  # faults before the stream: no response body is streamed
MOST_BEFORE = 4  # content chunks a mid-stream fault sends first, at most
MALFORMED = b'data: {"id": "chatcmpl-upstream", "choices": [{"delta": \n\n'


@dataclass(slots=True, frozen=True)
class Fault:
    kind: str
    after: int = 0  # content chunks sent before a mid-stream fault


@dataclass
class Faults:
    """Which requests fail, and how. `rate` 0 (the default) injects none."""

    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int | None = None
    stall_s: float = 30.0
    cut_pause_s: float = 0.2
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"fault kinds must be some of {', '.join(FAULT_KINDS)}: {unknown}")
        self.rng = random.Random(self.seed)

    def draw(self, tokens: int) -> Fault | None:
        """The fault of the next request (which streams `tokens` tokens), or None."""
        if not self.rate or self.rng.random() >= self.rate:
            return None
        kind = self.rng.choice(self.kinds)
        after = self.rng.randint(1, max(1, min(MOST_BEFORE, tokens - 1)))
        if kind in ANSWERED or kind == "stall_before":
            after = 0
        return Fault(kind, after)


class Listener(Protocol):
    """The standalone server's listening socket, which an outage can close for a while."""

    async def close_for(self, seconds: float) -> None: ...


@dataclass
class Outage:
    until: float = 0.0  # time.monotonic() until which every request is dropped
    listener: Listener | None = None  # set when the server runs standalone

    @property
    def active(self) -> bool:
        return time.monotonic() < self.until

    async def begin(self, seconds: float, how: str) -> None:
        """Drop every request for `seconds`; `how="refuse"` closes the listener too."""
        if how == "refuse":
            if self.listener is None:
                raise ValueError("`refuse` needs the server run standalone")
            await self.listener.close_for(seconds)
        elif how != "close":
            raise ValueError("how: close or refuse")
        self.until = time.monotonic() + seconds


@dataclass
class ChaosStats:
    requests: int = 0  # chat requests answered or faulted (not those dropped by an outage)
    continued: int = 0  # of them, continuations of an open assistant message
    tokens: int = 0  # generated tokens written to clients
    dropped: int = 0  # requests whose connection an outage closed
    faults: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "continued": self.continued,
            "tokens": self.tokens,
            "dropped": self.dropped,
            "faults": dict(self.faults),
        }


def drop(request: web.Request) -> web.Response:
    """Close the connection without an answer (the response returned is never written)."""
    if request.transport is not None:
        request.transport.close()
    return web.Response()


def answer(request: web.Request, fault: Fault) -> web.Response:
    """A fault that comes instead of a stream: a dropped connection, a 500 or a 429."""
    if fault.kind == "refuse":
        return drop(request)
    status = int(fault.kind)
    headers = {"retry-after": "1"} if status == 429 else None
    error = {"message": f"scripted fault {status}", "type": "server_error", "code": None}
    return web.json_response({"error": error}, status=status, headers=headers)


class Close:
    """A script step: close the connection here."""


CLOSE = Close()


def faulted(head: list, steps: list[list], tail: list, fault: Fault, faults: Faults) -> list:
    """A stream's script (role chunks, each token's steps, then finish, usage and `[DONE]`)
    as `fault` breaks it."""
    sent = [s for step in steps[: fault.after] for s in step]
    rest = [s for step in steps[fault.after :] for s in step]
    stall = float(faults.stall_s)  # a float step is a pause
    match fault.kind:
        case "cut":
            return [*head, *sent, float(faults.cut_pause_s), CLOSE]
        case "stall_before" | "stall_after":
            return [*head, *sent, stall, *rest, *tail]
        case "malformed":
            return [*head, *sent, MALFORMED]
        case "no_done":
            return [*head, *sent]
    raise ValueError(f"{fault.kind} is not a mid-stream fault")


# -- the admin routes ---------------------------------------------------------------------------


OUTAGE = web.AppKey("outage", Outage)
STATS = web.AppKey("chaos_stats", ChaosStats)


async def stats(request: web.Request) -> web.Response:
    """`GET /_chaos/stats`: what this server did so far."""
    return web.json_response(request.app[STATS].to_dict())


async def down(request: web.Request) -> web.Response:
    """`POST /_chaos/down?seconds=S[&how=close|refuse]`: an outage from now."""
    try:
        seconds = float(request.query.get("seconds", "30"))
        await request.app[OUTAGE].begin(seconds, request.query.get("how", "close"))
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from exc
    return web.json_response({"down_for_s": seconds})


@web.middleware
async def outage_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every request but `/_chaos/…` has its connection closed while an outage lasts."""
    if request.app[OUTAGE].active and not request.path.startswith("/_chaos/"):
        request.app[STATS].dropped += 1
        return drop(request)
    return await handler(request)


class SiteListener:
    """The standalone server's site: closed for an outage, then opened again on its port."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self.runner, self.host, self.port = runner, host, port
        self.site: web.TCPSite | None = None
        self._reopen: asyncio.Task | None = None

    async def open(self) -> None:
        self.site = web.TCPSite(self.runner, self.host, self.port)
        await self.site.start()

    async def close_for(self, seconds: float) -> None:
        if self.site is not None:
            await self.site.stop()
            self.site = None
        if self._reopen is not None:
            self._reopen.cancel()
        self._reopen = asyncio.create_task(self._open_after(seconds))

    async def _open_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.open()
