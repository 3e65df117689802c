"""`POST /v1/embeddings` through the real `openai` client, against a gateway in front of the
scripted OpenAI-compatible server: the upstream's own `/embeddings` is proxied (floats asked of
it, encoded here as the client asked), quotas count the inputs' tokens, the ledger records the
call, and a backend without embeddings is a 400 naming `model`."""

from __future__ import annotations

import openai
import pytest
import tomlkit
from openai import AsyncOpenAI

from gateway.state.ledger import JsonlLedger
from policies.tenants import create_key
from testkit.scripted_adapter import ScriptedAdapter
from testkit.scripted_upstream import EMBEDDING_SIZE, embedding_of
from tests.support.gateway import API_KEY, gateway_app

TEXTS = ["the cat sat on the mat", "a dog"]


@pytest.fixture
async def gateway(upstream, aiohttp_client, tmp_path):
    _, url = upstream
    app = gateway_app(upstream=[f"scripted={url}"], usage_file=str(tmp_path / "usage.jsonl"))
    return await aiohttp_client(app)


@pytest.fixture
def client(gateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=API_KEY, max_retries=0)


async def test_floats_and_the_sdks_default_base64_are_the_upstreams_vectors(client, upstream):
    floats = await client.embeddings.create(model="scripted", input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == "scripted"
    assert [d.index for d in floats.data] == [0, 1]
    for item, text in zip(floats.data, TEXTS, strict=True):
        assert item.embedding == pytest.approx(embedding_of(text))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 8
    decoded = await client.embeddings.create(model="scripted", input=TEXTS)  # base64 on the wire
    for item, text in zip(decoded.data, TEXTS, strict=True):
        assert item.embedding == pytest.approx(embedding_of(text), abs=1e-6)


async def test_dimensions_pass_through_and_an_upstream_refusal_names_them(client):
    short = await client.embeddings.create(model="scripted", input="a dog", dimensions=4)
    assert short.data[0].embedding == pytest.approx(embedding_of("a dog", 4), abs=1e-6)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.embeddings.create(model="scripted", input="x", dimensions=EMBEDDING_SIZE + 1)
    assert caught.value.body["param"] == "dimensions"


async def test_token_ids_are_refused_naming_input(client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.embeddings.create(model="scripted", input=[[1, 2, 3]])
    assert caught.value.body["param"] == "input"


async def test_the_ledger_records_each_call(client, tmp_path):
    await client.embeddings.create(model="scripted", input=TEXTS)
    records = [r async for r in JsonlLedger(tmp_path / "usage.jsonl").read()]
    assert [(r.model, r.status, r.prompt_tokens, r.generated_tokens) for r in records] == [
        ("scripted", "completed", 8, 0)
    ]
    assert records[0].run_id.startswith("emb-")


async def test_a_backend_without_embeddings_is_a_400_naming_model(aiohttp_client):
    app = gateway_app([ScriptedAdapter("chat-only", lambda request: [])])
    client = await aiohttp_client(app)
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await api.embeddings.create(model="chat-only", input="x")
    assert caught.value.body["param"] == "model"


async def test_the_tenants_rpm_counts_embeddings(upstream, aiohttp_client, tmp_path):
    _, url = upstream
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps({"tenants": {"acme": {"rpm": 1}}}), encoding="utf-8")
    key, _ = create_key(path, "acme")
    app = gateway_app(upstream=[f"scripted={url}"], tenants=str(path), api_key=[])
    client = await aiohttp_client(app)
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
    await api.embeddings.create(model="scripted", input="x")
    with pytest.raises(openai.RateLimitError):
        await api.embeddings.create(model="scripted", input="x")
