"""Prefix caches are per tenant (design §6): through the gateway and a real worker, a tenant's
repeated prompt hits its own cached blocks, another tenant's identical prompt finds none, and
tenants that opted into sharing share. A system prompt the tenants file declares shared is
cached once for every tenant, and nothing after it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import tomlkit

from adapters.worker_client import WorkerAdapter
from gateway.app_keys import AUTH
from policies.tenants_file import create_key
from policies.tenants_watch import reload_now
from testkit.tiny_model import build_tiny_tokenizer
from tests.support.gateway import chat_body, gateway_app
from tests.support.worker_process import Worker, running_worker
from workers.chat import render_prompt, shared_prefix_len
from workers.config import WorkerConfig

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


DECLARED = "You are the platform's shared assistant. Follow the house rules, answer politely. " * 4
UNDECLARED = "You are a private assistant of one customer. Its secrets are in this prompt. " * 4


async def test_a_declared_system_prompt_is_shared_by_all_tenants_and_nothing_after_it(
    aiohttp_client, worker, tmp_path
):
    path = tmp_path / "tenants.toml"
    tenants = {"acme": {}, "globex": {}, "initech": {}}
    shared_prompts = {"prefix_cache": {"shared_system_prompts": [DECLARED]}}
    path.write_text(tomlkit.dumps({**shared_prompts, "tenants": tenants}), encoding="utf-8")
    keys = {name: create_key(path, name)[0] for name in tenants}
    adapter = WorkerAdapter(worker.url, name="worker")
    client = await aiohttp_client(gateway_app(adapters=[adapter], tenants=str(path), api_key=[]))
    model = (await (await client.get("/v1/models", headers=auth(keys["acme"]))).json())["data"]

    async def ask(tenant: str, system: str, user: str) -> int:
        body = chat_body(model[0]["id"], max_tokens=1, temperature=0)
        body["messages"] = [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
        before = await hits(worker)
        resp = await client.post("/v1/chat/completions", json=body, headers=auth(keys[tenant]))
        assert resp.status == 200
        return await hits(worker) - before

    shared = shared_tokens(DECLARED, "What is paged attention?")
    assert shared >= 3 * 16  # several whole blocks
    assert await ask("acme", DECLARED, "What is paged attention?") == 0
    own = await ask("acme", DECLARED, "What is paged attention?")
    assert own > shared  # acme's own blocks after the shared prompt, too
    assert await ask("globex", DECLARED, "What is paged attention?") == shared  # not acme's rest
    assert await ask("globex", DECLARED, "And prefix caching?") == shared

    assert await ask("acme", UNDECLARED, "What is paged attention?") == 0
    assert await ask("globex", UNDECLARED, "What is paged attention?") == 0  # not declared
    assert await ask("acme", UNDECLARED, "What is paged attention?") > 0  # but acme's own

    # declared by a reload: from then on it is shared, though what acme cached before is not
    doc = tomlkit.parse(path.read_text(encoding="utf-8"))  # with the keys create_key wrote
    doc["prefix_cache"]["shared_system_prompts"] = [DECLARED, UNDECLARED]
    path.write_text(tomlkit.dumps(doc), encoding="utf-8")
    assert reload_now(path, client.server.app[AUTH].reload)  # what SIGHUP and the watcher do
    assert await ask("initech", UNDECLARED, "What is paged attention?") == 0
    assert await ask("globex", UNDECLARED, "Another question") == shared_tokens(UNDECLARED, "x")


def shared_tokens(system: str, user: str) -> int:
    """What a worker caches for every tenant of a prompt opening with `system`: the whole blocks
    of the system turn alone."""
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    length = shared_prefix_len(tokenizer, messages, render_prompt(tokenizer, messages))
    block = WorkerConfig().block_size
    return length // block * block


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
