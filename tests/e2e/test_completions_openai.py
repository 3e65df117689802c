"""End to end: the `openai` client's legacy `completions.create` against `sluice serve` with its
own worker on the tiny model: the raw prompt reaches the worker without a chat template (worker
API version 5's `prompt`), streamed and not alike."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

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
    out = client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=4, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == 4 == len(logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_token_ids_are_refused_naming_prompt(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[1, 2, 3])
    assert caught.value.body["param"] == "prompt"
