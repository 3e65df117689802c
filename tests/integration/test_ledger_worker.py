"""The usage ledger against a real worker: whatever way a run ends (completed, cancelled by the
client, its client gone, past its deadline), the tokens it bills are the tokens the worker
generated, tail included, and its prompt is the worker's own count."""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from adapters.events import Usage
from adapters.worker_client import WorkerAdapter
from gateway.protocol import parse_chat_request
from gateway.state.ledger import JsonlLedger, UsageRecord
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events
from tests.support.waiting import until
from tests.support.worker_process import Worker, running_worker

CHAT = "/v1/chat/completions"
PROMPTS = {
    "completed": "Count to three.",
    "cancelled": "Tell me a long story about a lighthouse keeper.",
    "disconnected": "Describe every room of a very large house, one by one.",
    "timed_out": "Write a poem about café au lait and 你好, as long as you can.",
}


async def generated_total(worker: Worker) -> float:
    """The worker's own count of generated tokens (its /metrics)."""
    async with aiohttp.ClientSession() as session, session.get(f"{worker.url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_worker_generated_tokens":
            (sample,) = [s for s in family.samples if s.name.endswith("_total")]
            return sample.value
    raise AssertionError("the worker exports no sluice_worker_generated_tokens_total")


async def prompt_tokens(worker: Worker, model: str, text: str) -> int:
    """The worker's usage prompt count for `text` as the one user message (one token made)."""
    adapter = WorkerAdapter(worker.url)
    await adapter.start()
    try:
        chat = parse_chat_request(chat_body(model, messages=_messages(text), max_tokens=1))
        usage = [
            e
            async for batch in adapter.stream(chat, f"probe-{uuid.uuid4().hex}")
            for e in batch
            if isinstance(e, Usage)
        ]
    finally:
        await adapter.close()
    assert len(usage) == 1
    return usage[0].prompt_tokens


async def worker_idle(worker: Worker) -> None:
    async def idle() -> bool:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{worker.url}/v1/stats") as resp,
        ):
            stats = await resp.json()
        return (stats["running"], stats["waiting"]) == (0, 0)

    await until(idle, "the worker to go idle")


async def ledger_records(path: Path, count: int) -> list[UsageRecord]:
    async def enough() -> list[UsageRecord] | None:
        records = [r async for r in JsonlLedger(path).read()]
        return records if len(records) >= count else None

    return await until(enough, f"{count} usage records")


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def request(model: str, name: str, **extra) -> dict:
    return chat_body(model, messages=_messages(PROMPTS[name]), temperature=0, **extra)


async def test_the_ledger_bills_what_the_worker_generated(aiohttp_client, tiny_model_dir, tmp_path):
    with running_worker(tiny_model_dir, tmp_path, "--max-num-seqs", "8") as worker:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{worker.url}/v1/model") as resp,
        ):
            model = (await resp.json())["id"]
        prompts = {name: await prompt_tokens(worker, model, text) for name, text in PROMPTS.items()}
        await worker_idle(worker)
        before = await generated_total(worker)

        usage_file = tmp_path / "usage.jsonl"
        main = await aiohttp_client(
            gateway_app(
                adapters=[WorkerAdapter(worker.url)], usage_file=str(usage_file), disconnect_grace=0
            )
        )
        hasty = await aiohttp_client(
            gateway_app(
                adapters=[WorkerAdapter(worker.url)],
                usage_file=str(usage_file),
                total_timeout=0.2,
            )
        )
        ids: dict[str, str] = {}

        done = await main.post(CHAT, json=request(model, "completed", max_tokens=16), headers=AUTH)
        assert done.status == 200
        ids["completed"] = (await done.json())["id"]

        live = await main.post(
            CHAT, json=request(model, "cancelled", max_tokens=600, stream=True), headers=AUTH
        )
        head = b"".join([await live.content.readuntil(b"\n\n") for _ in range(4)])
        ids["cancelled"] = sse_events(head)[0].json()["id"]
        cancel = await main.post(f"{CHAT}/{ids['cancelled']}/cancel", headers=AUTH)
        assert (await cancel.json())["status"] == "cancelled"
        assert sse_events(await live.read())[-2].json()["error"]["code"] == "cancelled"

        gone = await main.post(
            CHAT, json=request(model, "disconnected", max_tokens=600, stream=True), headers=AUTH
        )
        head = b"".join([await gone.content.readuntil(b"\n\n") for _ in range(4)])
        ids["disconnected"] = sse_events(head)[0].json()["id"]
        gone.close()  # the client hangs up; no grace window: the run is cancelled

        late = await hasty.post(
            CHAT, json=request(model, "timed_out", max_tokens=900, stream=True), headers=AUTH
        )
        late_events = sse_events(await late.read())
        ids["timed_out"] = late_events[0].json()["id"]
        assert late_events[-2].json()["error"]["code"] == "timeout"

        records = await ledger_records(usage_file, 4)
        await worker_idle(worker)
        after = await generated_total(worker)

    assert sorted(r.run_id for r in records) == sorted(ids.values())
    by_name = {name: next(r for r in records if r.run_id == ids[name]) for name in ids}
    expected = {
        "completed": ("completed", None),
        "cancelled": ("cancelled", "client"),
        "disconnected": ("cancelled", "disconnect"),
        "timed_out": ("timed_out", "timeout"),
    }
    for name, record in by_name.items():
        assert (record.status, record.cancel_source) == expected[name], name
        assert record.prompt_tokens == prompts[name] > 0, name
        assert record.generated_tokens >= record.sent_tokens + record.tail_tokens, name
    assert by_name["completed"].generated_tokens == 16
    for name in ("cancelled", "disconnected", "timed_out"):
        assert 0 < by_name[name].generated_tokens < 600, name
    assert sum(r.generated_tokens for r in records) == after - before
