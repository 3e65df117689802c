"""End to end: the `openai` client's legacy `completions.create` against `sluice serve` with its
own worker on the tiny model: the raw prompt reaches the worker without a chat template (worker
API's `prompt`), streamed and not alike; token ids, several prompts merged, and `echo`."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoConfig, AutoTokenizer

PROMPT = "Once upon a time, 你好 and café"


@pytest.fixture(scope="module")
def greedy(client, model):
    return client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12)


def test_not_streamed_the_raw_prompt_is_tokenized_as_is(greedy, tiny_model_dir, client, model):
    assert greedy.object == "text_completion"
    assert greedy.id.startswith("cmpl-")
    (choice,) = greedy.choices
    assert choice.text and choice.finish_reason == "length"
    assert greedy.usage.completion_tokens == 12
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert greedy.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=1
    )
    assert chat.usage.prompt_tokens > greedy.usage.prompt_tokens  # the template's own tokens


def test_stream_equals_non_stream(client, model, greedy):
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(ch.text for c in chunks for ch in c.choices) == greedy.choices[0].text
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens


def test_n_and_integer_logprobs(client, model):
    out = client.completions.create(  # greedy: a sampled choice may draw EOS within 4 tokens
        model=model, prompt=PROMPT, n=2, max_tokens=4, logprobs=2, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == 4 == len(logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_token_ids_are_the_prompt_as_the_worker_tokenizes_it(client, model, greedy, tiny_model_dir):
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT)["input_ids"]
    out = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=12)
    assert out.choices[0].text == greedy.choices[0].text
    assert out.usage.prompt_tokens == len(ids)


def test_token_ids_beyond_the_vocabulary_are_a_400_naming_prompt(client, model, tiny_model_dir):
    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[1, vocab])
    assert caught.value.body["param"] == "prompt"


def test_a_list_of_prompts_merges_as_openais(client, model, greedy, tiny_model_dir):
    out = client.completions.create(
        model=model, prompt=[PROMPT, "Another"], n=2, temperature=0, max_tokens=12
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == greedy.choices[0].text
    assert out.usage.completion_tokens == 4 * 12
    another = len(AutoTokenizer.from_pretrained(tiny_model_dir)("Another")["input_ids"])
    assert out.usage.prompt_tokens == greedy.usage.prompt_tokens + another


def test_a_streamed_list_of_prompts_with_echo(client, model, greedy):
    stream = client.completions.create(
        model=model,
        prompt=[PROMPT, "Another"],
        echo=True,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts[0] == PROMPT + greedy.choices[0].text
    assert texts[1].startswith("Another") and len(texts) == 2
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 2 * 12


def test_echo_not_streamed(client, model, greedy):
    out = client.completions.create(
        model=model, prompt=PROMPT, echo=True, temperature=0, max_tokens=12
    )
    assert out.choices[0].text == PROMPT + greedy.choices[0].text


def test_the_model_lists_every_route_that_serves_it(client, model):
    (listed,) = client.models.list().data
    assert listed.model_extra["endpoints"] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
    ]
