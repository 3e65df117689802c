"""Spend through the real app: a priced model's usage records (a chat run's, an embeddings
call's) cost their tokens at the config's price (a real worker's counts, its tail included),
`sluice_tenant_cost_total` adds them up, and a tenant past its `budget_cost` is refused as the
token budget refuses, on the in-process store and across two replicas sharing a real Redis."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.worker_client import WorkerAdapter
from policies.quotas import estimate_prompt_tokens
from testkit.scripted_adapter import ScriptedAdapter
from tests.integration.test_ledger_worker import ledger_records, request
from tests.integration.test_tenant_limits import (
    TENANT,
    error_of,
    exact_script,
    gateway,
    post,
    rejections,
    write_tenants,
)
from tests.support.gateway import sse_events
from tests.support.waiting import until
from tests.support.worker_process import running_worker

CHAT = "/v1/chat/completions"
PRICE = {"input_per_million": 1000.0, "output_per_million": 2000.0}  # readable amounts


def cost_of(prompt: int, generated: int) -> float:
    return (prompt * PRICE["input_per_million"] + generated * PRICE["output_per_million"]) / 1e6


async def tenant_cost(client) -> float:
    text = await (await client.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_tenant_cost":
            (sample,) = [s for s in family.samples if s.name == "sluice_tenant_cost_total"]
            assert sample.labels == {"tenant": TENANT}
            return sample.value
    raise AssertionError("no sluice_tenant_cost_total")


async def test_a_priced_models_records_cost_what_the_worker_generated(
    aiohttp_client, tiny_model_dir, tmp_path
):
    with running_worker(tiny_model_dir, tmp_path, "--max-num-seqs", "4") as worker:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{worker.url}/v1/model") as resp,
        ):
            model = (await resp.json())["id"]
        path, auth = write_tenants(tmp_path)
        usage_file = tmp_path / "usage.jsonl"
        client = await gateway(
            aiohttp_client,
            {},
            path,
            [WorkerAdapter(worker.url)],
            usage_file=str(usage_file),
            prices={model: PRICE},
        )
        assert await tenant_cost(client) == 0  # exported from the start
        done = await client.post(
            CHAT, json=request(model, "completed", max_tokens=16), headers=auth
        )
        assert done.status == 200
        live = await client.post(
            CHAT, json=request(model, "cancelled", max_tokens=600, stream=True), headers=auth
        )
        head = b"".join([await live.content.readuntil(b"\n\n") for _ in range(4)])
        run_id = sse_events(head)[0].json()["id"]
        cancel = await client.post(f"{CHAT}/{run_id}/cancel", headers=auth)
        assert (await cancel.json())["status"] == "cancelled"
        await live.read()

        records = await ledger_records(usage_file, 2)
        for record in records:
            assert record.prompt_tokens > 0 and record.generated_tokens > 0
            assert record.cost == pytest.approx(
                cost_of(record.prompt_tokens, record.generated_tokens), rel=1e-9
            )
        cancelled = next(r for r in records if r.status == "cancelled")
        assert cancelled.generated_tokens >= cancelled.sent_tokens + cancelled.tail_tokens
        assert await tenant_cost(client) == pytest.approx(sum(r.cost for r in records))


async def test_an_unpriced_models_records_have_no_cost(aiohttp_client, tmp_path):
    path, auth = write_tenants(tmp_path)
    usage_file = tmp_path / "usage.jsonl"
    client = await gateway(
        aiohttp_client,
        {},
        path,
        [ScriptedAdapter("scripted", exact_script)],
        usage_file=str(usage_file),
        prices={"another": PRICE},  # a model nobody serves: a warning at start, no error
    )
    assert (await post(client, auth, max_tokens=4)).status == 200
    (record,) = await ledger_records(usage_file, 1)
    assert record.cost is None
    assert await tenant_cost(client) == 0


async def test_a_tenant_past_its_budget_cost_is_refused_as_the_token_budget_is(
    aiohttp_client, store_settings, tmp_path
):
    max_tokens = 30
    prompt = estimate_prompt_tokens([("user", "Hi")])  # what exact_script reports, too
    one_run = cost_of(prompt, max_tokens)
    path, auth = write_tenants(tmp_path, budget_cost=one_run * 1.5, budget_period="1d")
    # two replicas sharing Redis (one spends, the other refuses); the in-process store: one
    clients = [
        await gateway(
            aiohttp_client,
            store_settings,
            path,
            [ScriptedAdapter("scripted", exact_script)],
            prices={"scripted": PRICE},
        )
        for _ in range(2 if store_settings else 1)
    ]
    first = await post(clients[0], auth, max_tokens=max_tokens)
    assert first.status == 200
    # counted as the run settles, which may come a moment after its answer
    counted = await until(lambda: tenant_cost(clients[0]), "the run's cost to be counted")
    assert counted == pytest.approx(one_run)
    spent = await post(clients[-1], auth, max_tokens=max_tokens)
    assert spent.status == 429
    error = await error_of(spent)
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert error["message"].startswith("Cost budget exceeded")
    assert int(spent.headers["retry-after"]) <= 86400
    assert await rejections(clients[-1]) == {"budget_cost": 1}
    small = await post(clients[-1], auth, max_tokens=1)  # what is left still buys a short one
    assert small.status == 200


async def test_an_embeddings_call_costs_its_inputs_at_the_input_price(
    upstream, aiohttp_client, tmp_path
):
    _, url = upstream
    path, auth = write_tenants(tmp_path)
    usage_file = tmp_path / "usage.jsonl"
    client = await gateway(
        aiohttp_client,
        {},
        path,
        None,
        upstream=[f"scripted={url}"],
        usage_file=str(usage_file),
        prices={"scripted": PRICE},
    )
    body = {"model": "scripted", "input": ["the cat sat on the mat", "a dog"]}
    answer = await client.post("/v1/embeddings", json=body, headers=auth)
    assert answer.status == 200
    prompt = (await answer.json())["usage"]["prompt_tokens"]
    (record,) = await ledger_records(usage_file, 1)
    assert record.cost == pytest.approx(cost_of(prompt, 0))
    assert await tenant_cost(client) == pytest.approx(record.cost)
