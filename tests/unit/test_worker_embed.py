"""The worker's `POST /v1/embed` on the tiny model: unit vectors, one per input, stable."""

from __future__ import annotations

import math

from tests.support.worker_app import started_worker_app
from wire.embed_body import MAX_EMBED_INPUTS


async def embed(client, inputs: list[str], **extra) -> tuple[int, dict]:
    body = {"request_id": "emb-1", "input": inputs, **extra}
    response = await client.post("/v1/embed", json=body)
    return response.status, await response.json()


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b, strict=True))


async def test_vectors_are_unit_norm_stable_and_distinct(aiohttp_client, loaded, tiny_model_dir):
    client = await started_worker_app(aiohttp_client, loaded, tiny_model_dir)
    texts = ["the cat sat", "a different text entirely", "the cat sat"]
    status, answer = await embed(client, texts)
    assert status == 200
    vectors = answer["data"]
    size = loaded.model.config.hidden_size
    assert [len(v) for v in vectors] == [size] * 3
    assert all(abs(norm(v) - 1.0) < 1e-5 for v in vectors)
    assert close(vectors[0], vectors[2])  # same input, same vector
    assert not close(vectors[0], vectors[1])
    tokens = [len(loaded.tokenizer(t)["input_ids"]) for t in texts]
    assert answer["prompt_tokens"] == sum(tokens)
    one_by_one = [(await embed(client, [t]))[1]["data"][0] for t in texts]
    assert all(close(a, b) for a, b in zip(vectors, one_by_one, strict=True))


async def test_dimensions_truncate_then_renormalise(aiohttp_client, loaded, tiny_model_dir):
    client = await started_worker_app(aiohttp_client, loaded, tiny_model_dir)
    _, full = await embed(client, ["the cat sat"])
    status, short = await embed(client, ["the cat sat"], dimensions=8)
    assert status == 200
    vector, head = short["data"][0], full["data"][0][:8]
    assert len(vector) == 8 and abs(norm(vector) - 1.0) < 1e-5
    assert close(vector, [x / norm(head) for x in head])


async def test_refusals_name_the_field(aiohttp_client, loaded, tiny_model_dir):
    client = await started_worker_app(aiohttp_client, loaded, tiny_model_dir)
    size = loaded.model.config.hidden_size
    cases = [
        ({"dimensions": size + 1}, ["x"], "dimensions"),
        ({"dimensions": 0}, ["x"], "dimensions"),
        ({}, [], "input"),
        ({}, [""], "input"),
        ({}, ["x"] * (MAX_EMBED_INPUTS + 1), "input"),
        ({}, ["word " * 2000], "input"),  # past the tiny model's 1,024-token context
    ]
    for extra, inputs, param in cases:
        status, answer = await embed(client, inputs, **extra)
        assert (status, answer["error"]["param"]) == (400, param), (extra, len(inputs))


async def test_token_ids_embed_as_their_text_does(aiohttp_client, loaded, tiny_model_dir):
    client = await started_worker_app(aiohttp_client, loaded, tiny_model_dir)
    text = "the cat sat"
    ids = loaded.tokenizer(text)["input_ids"]  # as the worker tokenizes a text input
    _, by_text = await embed(client, [text])
    status, by_ids = await embed(client, [ids, ids[:2]])
    assert status == 200 and by_ids["prompt_tokens"] == len(ids) + 2
    assert close(by_ids["data"][0], by_text["data"][0])
    vocab = loaded.model.config.vocab_size
    for inputs in ([[vocab]], [[1], "mixed"], [[]], [[-1]]):
        status, answer = await embed(client, inputs)
        assert (status, answer["error"]["param"]) == (400, "input"), inputs
