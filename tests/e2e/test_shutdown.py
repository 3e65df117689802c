"""SIGTERM on a real `sluice serve` (gateway + its own worker on the tiny model) with streams
live: every client gets its run's end and `[DONE]`, the process exits 0 promptly, and no worker
process outlives it."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import httpx
import orjson
import psutil
import pytest

from tests.support.serve import Served, serving

# alone (tests/support/tiers.py): it times how soon live streams end on SIGTERM
pytestmark = pytest.mark.alone

STREAMS = 10
SHUTDOWN_TIMEOUT = 1.0


async def follow(
    session: aiohttp.ClientSession, gateway: Served, model: str, live: asyncio.Event
) -> list:
    """One stream's payloads (the last one "[DONE]"); `live` is set at its first text."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 900,  # far more than a second's worth: live when SIGTERM comes
        "stream": True,
    }
    url = f"{gateway.base_url}/chat/completions"
    payloads: list = []
    async with session.post(url, json=body, headers=gateway.auth) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :].strip()
            payloads.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
            if len(payloads) > 1:
                live.set()
    return payloads


def ended_cleanly(payloads: list) -> bool:
    """A terminal event, then [DONE]: finished with a finish_reason, or cancelled."""
    if len(payloads) < 2 or payloads[-1] != "[DONE]":
        return False
    last = payloads[-2]
    if "error" in last:
        return last["error"]["code"] == "cancelled"
    return any(c["finish_reason"] for c in last["choices"])


async def streams_through_sigterm(gateway: Served, model: str) -> tuple[list[list], float]:
    """Start the streams, SIGTERM the gateway once all are live, read them to their end: the
    payloads of each, and when the signal was sent."""
    async with aiohttp.ClientSession() as session:
        live = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(follow(session, gateway, model, e)) for e in live]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in live)), 60)
        gateway.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        return await asyncio.wait_for(asyncio.gather(*streams), 30), sent


def test_sigterm_ends_every_live_stream_then_exits(tiny_model_dir):
    flags = ("--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    with serving(tiny_model_dir, *flags) as gateway:
        model = httpx.get(f"{gateway.base_url}/models", headers=gateway.auth).json()["data"][0]
        children = psutil.Process(gateway.proc.pid).children(recursive=True)
        assert children  # the local worker
        results, sent = asyncio.run(streams_through_sigterm(gateway, model["id"]))
        code = gateway.proc.wait(30)
        took = time.monotonic() - sent
    assert code == 0
    assert took < SHUTDOWN_TIMEOUT + 10  # the drain, the cancels' settling, the worker's stop
    assert [r[-2:] for r in results if not ended_cleanly(r)] == []
    assert [p.pid for p in children if p.is_running()] == []
