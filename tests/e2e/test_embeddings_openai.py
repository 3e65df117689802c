"""End to end: the `openai` client's `embeddings.create` against `sluice serve` with its own
worker on the tiny model (worker API version 6's `/v1/embed`): unit vectors of the model's
mean-pooled final hidden state, as floats and as the SDK's default base64, alike."""

from __future__ import annotations

import math

import openai
import pytest
from transformers import AutoTokenizer

TEXTS = ["Once upon a time", "你好 and café", "Once upon a time"]


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


@pytest.fixture(scope="module")
def floats(client, model):
    return client.embeddings.create(model=model, input=TEXTS, encoding_format="float")


def test_unit_vectors_the_same_for_the_same_text(floats, model, tiny_model_dir):
    assert floats.object == "list" and floats.model == model
    vectors = [d.embedding for d in floats.data]
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert all(abs(norm(v) - 1.0) < 1e-5 for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-6)
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens


def test_the_sdks_default_base64_decodes_to_the_same_floats(floats, client, model):
    decoded = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    for a, b in zip(decoded.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)  # float32 on the wire


def test_one_by_one_equals_the_batch(floats, client, model):
    for text, item in zip(TEXTS, floats.data, strict=True):
        (alone,) = client.embeddings.create(model=model, input=text, encoding_format="float").data
        assert alone.embedding == pytest.approx(item.embedding, abs=1e-5)


def test_token_ids_embed_as_their_text(floats, client, model, tiny_model_dir):
    ids = [AutoTokenizer.from_pretrained(tiny_model_dir)(t)["input_ids"] for t in TEXTS[:2]]
    answer = client.embeddings.create(model=model, input=ids, encoding_format="float")
    for by_ids, by_text in zip(answer.data, floats.data[:2], strict=True):
        assert by_ids.embedding == pytest.approx(by_text.embedding, abs=1e-5)
    assert answer.usage.prompt_tokens == sum(map(len, ids))
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, input=[[10**6]])  # past the vocabulary
    assert caught.value.body["param"] == "input"


def test_dimensions_within_the_models_size(client, model):
    (short,) = client.embeddings.create(model=model, input="hi", dimensions=8).data
    assert len(short.embedding) == 8 and abs(norm(short.embedding) - 1.0) < 1e-5
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, input="hi", dimensions=1 << 20)
    assert caught.value.body["param"] == "dimensions"
