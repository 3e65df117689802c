"""The legacy Completions API through the real `openai` client, against a gateway in front of a
scripted OpenAI-compatible server: the request goes upstream to its `/completions` (a raw
prompt, no chat template), and the answer comes back in the `text_completion` shape."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from tests.support.gateway import API_KEY, gateway_app

TOKENS = ["tok0 ", "tok1 ", "tok2 ", "tok3 "]


@pytest.fixture
async def gateway(upstream, aiohttp_client):
    _, url = upstream
    app = gateway_app(upstream=[f"scripted={url}"], ping_interval=0.05, disconnect_grace=0)
    return await aiohttp_client(app)


@pytest.fixture
def client(gateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=API_KEY, max_retries=0)


async def test_not_streamed_through_the_openai_client(client, upstream):
    state, _ = upstream
    completion = await client.completions.create(
        model="scripted", prompt="Once upon a time", max_tokens=4, logprobs=2
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert choice.text == "".join(TOKENS)
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == TOKENS
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert completion.usage.completion_tokens == 4
    (record,) = state.records
    assert record.body["prompt"] == "Once upon a time" and "messages" not in record.body
    assert record.body["logprobs"] == 2


async def test_streamed_through_the_openai_client(client):
    stream = await client.completions.create(
        model="scripted",
        prompt=["Once upon a time"],
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "text_completion" for c in chunks)
    for index in (0, 1):
        text = "".join(ch.text for c in chunks for ch in c.choices if ch.index == index)
        assert text == "".join(TOKENS)
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert reasons == ["length", "length"]
    assert chunks[-1].usage.completion_tokens == 8


async def test_an_unsupported_field_is_the_sdks_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="scripted", prompt="Hi", suffix="end")
    assert caught.value.body["param"] == "suffix"


async def test_token_id_prompts_pass_through_each_its_own_request(client, upstream):
    state, _ = upstream
    completion = await client.completions.create(
        model="scripted", prompt=[[1, 2, 3], [4, 5]], max_tokens=2
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert [c.text for c in completion.choices] == ["tok0 tok1 "] * 2
    assert completion.usage.completion_tokens == 4
    assert sorted(r.body["prompt"] for r in state.records) == [[1, 2, 3], [4, 5]]
