"""`POST /v1/embeddings` through the real `openai` client, against a gateway in front of the
scripted OpenAI-compatible server: the upstream's own `/embeddings` is proxied (floats asked of
it, encoded here as the client asked), quotas count the inputs' tokens, the ledger records every
call (a failed one too), a backend without embeddings is a 400 naming `model`, and a model
alias's targets serve embeddings in turn."""

from __future__ import annotations

import openai
import pytest
import tomlkit
from openai import AsyncOpenAI

from adapters.openai_upstream import OpenAIUpstreamAdapter
from gateway.state.ledger import JsonlLedger
from policies.quotas import estimate_prompt_tokens
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter
from testkit.scripted_upstream import EMBEDDING_SIZE, embedding_of
from tests.support.gateway import API_KEY, AUTH, gateway_app

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


async def test_token_ids_go_to_the_upstream_as_they_are(client):
    answer = await client.embeddings.create(
        model="scripted", input=[[1, 2, 3], [40, 5]], encoding_format="float"
    )
    assert [d.embedding for d in answer.data] == [
        pytest.approx(embedding_of("1 2 3")),
        pytest.approx(embedding_of("40 5")),
    ]
    assert answer.usage.prompt_tokens == 5  # the scripted upstream counts an id as a token
    with pytest.raises(openai.BadRequestError) as caught:
        await client.embeddings.create(model="scripted", input=[[1, 2], "mixed"])
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


async def test_a_failed_call_leaves_a_failed_record_with_no_tokens(upstream, client, tmp_path):
    state, _ = upstream
    state.status_for["scripted"] = (500, {"error": {"message": "upstream detail"}})
    with pytest.raises(openai.InternalServerError) as caught:
        await client.embeddings.create(model="scripted", input=TEXTS)
    assert "upstream detail" not in str(caught.value.body)
    records = [r async for r in JsonlLedger(tmp_path / "usage.jsonl").read()]
    assert [(r.status, r.prompt_tokens, r.generated_tokens) for r in records] == [("failed", 0, 0)]


async def test_the_tenants_tpm_counts_the_input_tokens(upstream, aiohttp_client, tmp_path):
    _, url = upstream
    estimate = estimate_prompt_tokens([("user", t) for t in TEXTS])
    counted = 8  # what the scripted upstream counts for TEXTS (a token per word)
    path = tmp_path / "tenants.toml"
    tenant = {"tpm": counted + estimate - 1}  # room for one call's estimate, not two calls
    path.write_text(tomlkit.dumps({"tenants": {"acme": tenant}}), encoding="utf-8")
    key, _ = create_key(path, "acme")
    app = gateway_app(upstream=[f"scripted={url}"], tenants=str(path), api_key=[])
    client = await aiohttp_client(app)
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
    first = await api.embeddings.create(model="scripted", input=TEXTS)
    assert first.usage.prompt_tokens == counted
    with pytest.raises(openai.RateLimitError):  # the first call's 8 tokens stay counted
        await api.embeddings.create(model="scripted", input=TEXTS)


@pytest.fixture
async def alias_client(upstream, aiohttp_client, tmp_path):
    _, url = upstream
    chat_only = ScriptedAdapter("chat-only", lambda request: [])
    app = gateway_app(
        [chat_only, *(OpenAIUpstreamAdapter(m, url) for m in ("first", "second"))],
        models={
            "embed": {"targets": ["first", "second"]},
            "mixed": {"targets": ["chat-only", "second"]},
        },
        usage_file=str(tmp_path / "usage.jsonl"),
    )
    return await aiohttp_client(app)


async def test_an_alias_serves_embeddings_from_its_first_target(alias_client, upstream):
    resp = await alias_client.post(
        "/v1/embeddings", json={"model": "embed", "input": "x"}, headers=AUTH
    )
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == "first;served"
    assert (await resp.json())["model"] == "first"


@pytest.mark.parametrize(("status", "reason"), [(500, "failed"), (503, "unavailable")])
async def test_an_alias_hands_a_failed_call_to_the_next_target(
    alias_client, upstream, tmp_path, status, reason
):
    state, _ = upstream
    state.status_for["first"] = (status, {"error": {"message": "down"}})
    resp = await alias_client.post(
        "/v1/embeddings", json={"model": "embed", "input": "x"}, headers=AUTH
    )
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == f"first;skipped={reason}, second;served"
    assert (await resp.json())["model"] == "second"
    records = [r async for r in JsonlLedger(tmp_path / "usage.jsonl").read()]
    assert [(r.model, r.status) for r in records] == [("second", "completed")]


async def test_an_alias_passes_over_a_target_without_embeddings(alias_client):
    resp = await alias_client.post(
        "/v1/embeddings", json={"model": "mixed", "input": "x"}, headers=AUTH
    )
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == "chat-only;skipped=unsupported, second;served"
