"""Prefix caches are per tenant (design §6): through the gateway and a real worker, a tenant's
repeated prompt hits its own cached blocks, another tenant's identical prompt finds none, and
tenants that opted into sharing share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import tomlkit

from adapters.worker_client import WorkerAdapter
from policies.tenants import create_key
from tests.support.gateway import chat_body, gateway_app
from tests.support.worker_process import Worker, running_worker

# long enough for several full KV blocks of the tiny model's tokenizer
PROMPT = "Tell me about the history of paged attention and prefix caching. " * 8


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    with running_worker(tiny_model_dir, tmp_path_factory.mktemp("prefix-worker")) as started:
        yield started


async def hits(worker: Worker) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{worker.url}/v1/stats") as resp:
        return (await resp.json())["prefix_cache_hits"]


async def test_a_tenants_cached_prompt_is_its_own_unless_both_share(
    aiohttp_client, worker, tmp_path
):
    path = tmp_path / "tenants.toml"
    tenants = {
        "acme": {},
        "globex": {},
        "open-a": {"share_prefix_cache": True},
        "open-b": {"share_prefix_cache": True},
    }
    path.write_text(tomlkit.dumps({"tenants": tenants}), encoding="utf-8")
    keys = {name: create_key(path, name)[0] for name in tenants}
    adapter = WorkerAdapter(worker.url, name="worker")
    client = await aiohttp_client(gateway_app(adapters=[adapter], tenants=str(path), api_key=[]))
    model = (await (await client.get("/v1/models", headers=auth(keys["acme"]))).json())["data"]
    body = chat_body(model[0]["id"], max_tokens=1, temperature=0)
    body["messages"] = [{"role": "user", "content": PROMPT}]

    async def ask(tenant: str) -> int:
        before = await hits(worker)
        resp = await client.post("/v1/chat/completions", json=body, headers=auth(keys[tenant]))
        assert resp.status == 200
        return await hits(worker) - before

    assert await ask("acme") == 0  # nothing cached yet
    assert await ask("acme") > 0  # its own prompt, cached
    assert await ask("globex") == 0  # the same prompt, another tenant: not shared
    assert await ask("open-a") == 0  # a sharing tenant does not see the isolated ones
    assert await ask("open-b") > 0  # but shares with the other sharing tenant


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
