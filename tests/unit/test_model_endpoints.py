"""`GET /v1/models` says which routes serve each model (`endpoints`): every generation API for
any backend, `/v1/embeddings` only where the backend computes embeddings, and for an alias the
union of its targets'. The `openai` SDK reads the objects with the field as an extra."""

from __future__ import annotations

from openai.types import Model

from gateway.model_endpoints import EMBEDDINGS, GENERATION
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, gateway_app
from wire.embed_body import Embeddings


class EmbeddingAdapter(ScriptedAdapter):
    """A scripted backend that also serves embeddings."""

    async def embed(self, inputs, dimensions, request_id, share=None) -> Embeddings:
        return Embeddings([[1.0] for _ in inputs], len(inputs))


async def test_each_model_lists_the_routes_that_serve_it(aiohttp_client):
    adapters = [
        ScriptedAdapter("chat-a", text_script(["a"])),
        ScriptedAdapter("chat-b", text_script(["b"])),
        EmbeddingAdapter("both", text_script(["e"])),
    ]
    aliases = {
        "mixed": {"targets": ["chat-a", "both"]},
        "plain": {"targets": ["chat-a", "chat-b"]},
    }
    client = await aiohttp_client(gateway_app(adapters=adapters, models=aliases))
    listed = await (await client.get("/v1/models", headers=AUTH)).json()
    endpoints = {m["id"]: m["endpoints"] for m in listed["data"]}
    generation, everything = list(GENERATION), [*GENERATION, EMBEDDINGS]
    assert endpoints == {
        "chat-a": generation,
        "chat-b": generation,
        "both": everything,
        "mixed": everything,  # the union: a call goes to the target that serves it
        "plain": generation,
    }
    one = await (await client.get("/v1/models/both", headers=AUTH)).json()
    model = Model.model_validate(one)
    assert model.id == "both" and model.model_extra["endpoints"] == everything
