"""An opening whose reply is lost with its connection: the gateway's client sends it again on a
fresh connection
(gateway/state/redis_client.py), and the script had already run. The resend must get
the first answer back, not claim, admit and count the tenant's request a second time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from urllib.parse import urlparse

import pytest

from gateway.state.quotas_redis import ADMIT, RedisQuotaStore
from gateway.state.redis_client import SharedRedis
from gateway.state.redis_open import OPEN, KeyClaim, RedisOpener
from gateway.state.run_store import RunRecord
from gateway.state.run_store_mirrored import MirroredRunStore
from gateway.state.run_store_redis import RedisRunStore
from policies.idempotency import RedisIdempotencyStore
from policies.quotas import QuotaExceeded, QuotaLimits, QuotaRequest

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TWO_AT_A_TIME = QuotaLimits(rpm=10, max_concurrent=2)


class ReplyDropper:
    """A TCP proxy to Redis that, once armed with a marker, forwards the next command holding it,
    swallows Redis's reply and closes that client connection: a reply lost on the way back."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.marker: bytes | None = None
        self.dropped = 0  # replies swallowed
        self.server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        doomed = asyncio.Event()  # this connection's next reply is to be lost
        for pump in (
            self._requests(reader, up_writer, doomed),
            self._replies(up_reader, writer, doomed),
        ):
            task = asyncio.create_task(pump)
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _requests(self, source, sink, doomed: asyncio.Event) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if self.marker is not None and self.marker in data:
                    self.marker = None
                    doomed.set()
                sink.write(data)
                await sink.drain()
        sink.close()

    async def _replies(self, source, sink, doomed: asyncio.Event) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if doomed.is_set():  # Redis ran it and answered; the client never hears
                    self.dropped += 1
                    break
                sink.write(data)
                await sink.drain()
        sink.close()


@pytest.fixture
async def opening_through_dropper():
    """An opener on the gateway's client, which reaches Redis through a `ReplyDropper`."""
    target = urlparse(REDIS_URL)
    dropper = ReplyDropper(target.hostname or "127.0.0.1", target.port or 6379)
    shared = SharedRedis(await dropper.start())
    client = shared.redis
    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}:"
    keys = RedisIdempotencyStore(client, prefix)
    quotas = RedisQuotaStore(client, prefix)
    runs = MirroredRunStore(RedisRunStore(client, prefix=prefix), shared.health)
    sha = await client.script_load(OPEN)  # so the first call is the script itself, not NOSCRIPT
    yield RedisOpener(keys, quotas, runs), quotas, dropper, sha.encode()
    await runs.close()
    found = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if found:
        await client.delete(*found)
    await shared.close()
    await dropper.close()


def quota(run_id: str) -> QuotaRequest:
    return QuotaRequest("acme", run_id, 10, TWO_AT_A_TIME)


async def counted_once(quotas: RedisQuotaStore) -> None:
    """run-1 holds one request and one of the two slots: run-2 gets the other, run-3 none."""
    headers = await quotas.headers("acme", TWO_AT_A_TIME)
    assert headers["x-ratelimit-remaining-requests"] == "9"  # one request counted, not two
    assert (await quotas.admit(quota("run-2"))).run_id == "run-2"  # the second slot is free
    with pytest.raises(QuotaExceeded) as refused:
        await quotas.admit(quota("run-3"))
    assert refused.value.limit == "concurrency"


async def test_an_opening_sent_again_after_its_reply_was_lost_counts_once(opening_through_dropper):
    opener, quotas, dropper, sha = opening_through_dropper
    claim = KeyClaim("acme", "key-1", "sha256:a", "run-1", ttl=60.0)
    record = RunRecord("run-1", tenant="acme", model="m", created=0.0)
    dropper.marker = sha
    opening = await opener.open(claim, quota("run-1"), record)
    assert dropper.dropped == 1  # the first send ran in Redis; its answer was lost
    assert opening.held is None
    assert opening.admission is not None and opening.admission.run_id == "run-1"
    assert opening.admission.headers["x-ratelimit-remaining-requests"] == "9"
    await counted_once(quotas)


async def test_another_opening_of_a_taken_run_id_is_still_refused(opening_through_dropper):
    opener, _, _, _ = opening_through_dropper
    record = RunRecord("run-1", tenant="acme", model="m", created=0.0)
    await opener.open(None, quota("run-1"), record)
    with pytest.raises(ValueError, match="exists"):  # not a resend: a token of its own
        await opener.open(None, quota("run-1"), record)


async def test_an_admission_sent_again_after_its_reply_was_lost_counts_once(
    opening_through_dropper,
):
    """The admission outside the opening script (a run store apart from Redis): its resend is
    answered as admitted, not refused as "already admitted" with the slot held."""
    _, quotas, dropper, _ = opening_through_dropper
    dropper.marker = (await quotas.redis.script_load(ADMIT)).encode()
    admission = await quotas.admit(quota("run-1"))
    assert dropper.dropped == 1  # the first send ran in Redis; its answer was lost
    assert admission.run_id == "run-1"
    await counted_once(quotas)
