"""The gateway in front of scripted upstreams that fail in every way (testkit/upstream_faults.py):
for each fault kind, what the client sees, the run's terminal state and its usage record.

Two OpenAI-compatible members of one model, over real HTTP: one injects the fault into every
stream, the other is healthy. A fault before the first token (a refused connection, a 500, a
429 with `retry-after`) is retried on the other member; a stall before it only delays the
stream; one after it (a cut, a stall, a malformed chunk, no `[DONE]`) continues the run on the
other member from its text. Every time the client reads the uninterrupted text, the run
completes, and the ledger keeps one record whose generated tokens are what the members wrote.
With no healthy member, a run cut mid-stream ends with one error event and `[DONE]`.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from gateway.backends.local_worker import free_port
from gateway.state.ledger import JsonlLedger, UsageRecord
from testkit.scripted_upstream import UpstreamState, make_app, token_text
from testkit.upstream_faults import FAULT_KINDS, Faults
from tests.support.gateway import AUTH, chat_body, gateway_app, stream_payloads, stream_text
from tests.support.processes import stop, wait_ready
from tests.support.waiting import until, until_sync

TOKENS = 12
WHOLE = "".join(token_text(i) for i in range(TOKENS))
STALL_TIMEOUT = 0.5  # the gateway's: a member silent this long mid-stream has failed


async def members(aiohttp_server, *states: UpstreamState) -> list[str]:
    """Each scripted upstream served over HTTP: its `--upstream` flag's value."""
    urls = []
    for state in states:
        server = await aiohttp_server(make_app(state))
        urls.append(f"scripted=http://127.0.0.1:{server.port}/v1")
    return urls


async def gateway(aiohttp_client, aiohttp_server, tmp_path, *states: UpstreamState):
    app = gateway_app(
        upstream=await members(aiohttp_server, *states),
        usage_file=str(tmp_path / "usage.jsonl"),
        stall_timeout=STALL_TIMEOUT,
        pool_routing="least_load",
    )
    return await aiohttp_client(app)


async def ask(client, prompt: str) -> list:
    body = chat_body(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    resp = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status == 200
    return stream_payloads(await resp.read())


async def ledger(tmp_path, count: int) -> list[UsageRecord]:
    async def enough() -> list[UsageRecord] | None:
        records = [r async for r in JsonlLedger(tmp_path / "usage.jsonl").read()]
        return records if len(records) >= count else None

    return await until(enough, f"{count} usage records")


@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_a_fault_on_one_member_is_invisible_to_the_client(
    aiohttp_client, aiohttp_server, tmp_path, kind
):
    # a stall before the first token is outwaited (0.3 s); one after it outlasts the gateway's
    # stall timeout, so the run moves on
    stall = 0.3 if kind == "stall_before" else 3.0
    faulty = UpstreamState(faults=Faults(rate=1.0, kinds=(kind,), seed=1, stall_s=stall))
    healthy = UpstreamState()
    client = await gateway(aiohttp_client, aiohttp_server, tmp_path, faulty, healthy)
    runs = []
    while not faulty.stats.faults:  # the pool takes turns: the first or second request
        assert len(runs) < 2, "the faulty member was never routed to"
        runs.append(await ask(client, f"request {len(runs)}"))
    for payloads in runs:
        assert stream_text(payloads) == WHOLE
        assert payloads[-1] == "[DONE]"
        assert not [p for p in payloads if isinstance(p, dict) and "error" in p]
        assert payloads[-2]["usage"]["completion_tokens"] == TOKENS
    records = await ledger(tmp_path, len(runs))
    assert len(records) == len(runs)
    assert {r.run_id for r in records} == {p[0]["id"] for p in runs}
    assert all(r.status == "completed" and r.generated_tokens == TOKENS for r in records)
    assert faulty.stats.tokens + healthy.stats.tokens == TOKENS * len(runs)
    if kind in ("cut", "stall_after", "malformed", "no_done"):
        assert healthy.stats.continued == 1  # went on from the text the faulty member sent
    else:
        assert healthy.stats.continued == 0  # retried, or outwaited, from the start


async def test_with_no_healthy_member_a_cut_run_ends_with_one_error_event(
    aiohttp_client, aiohttp_server, tmp_path
):
    only = UpstreamState(faults=Faults(rate=1.0, kinds=("cut",), seed=1, cut_pause_s=0.05))
    client = await gateway(aiohttp_client, aiohttp_server, tmp_path, only)
    payloads = await ask(client, "doomed")
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert [e["error"]["code"] for e in errors] == ["worker_failed"]
    assert payloads[-1] == "[DONE]" and payloads[-2] is errors[0]
    assert WHOLE.startswith(stream_text(payloads))  # what came is the text, nothing repeated
    (record,) = await ledger(tmp_path, 1)
    assert record.status == "failed" and record.run_id == payloads[0]["id"]
    assert record.generated_tokens == only.stats.tokens


@pytest.mark.process
def test_a_refusing_outage_closes_the_port_and_opens_it_again():
    port = free_port()
    cmd = [sys.executable, "-m", "testkit.scripted_upstream", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{base}/v1/models")
        resp = httpx.post(f"{base}/_chaos/down", params={"seconds": "1.5", "how": "refuse"})
        assert resp.json() == {"down_for_s": 1.5}
        with pytest.raises(httpx.ConnectError):  # a fresh connection: refused
            httpx.get(f"{base}/v1/models")

        def back() -> bool:
            try:
                return httpx.get(f"{base}/v1/models").status_code == 200
            except httpx.ConnectError:
                return False

        until_sync(back, "the port open again", within=10)
        assert httpx.get(f"{base}/_chaos/stats").json()["requests"] == 0
    finally:
        stop(proc)
    assert proc.returncode == 0  # SIGTERM: a clean stop
