"""End to end: the official `openai` client (sync and async) against `sluice serve` running its
own worker process on the tiny model."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import DISCONNECT_GRACE, E2E_KEY
from tests.support.waiting import until_sync

PROMPT = [{"role": "user", "content": "Tell me a story about 你好 and café."}]


@pytest.fixture
def aclient(served) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=served.base_url, api_key=E2E_KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy(client, model):
    """The reference answer: greedy, 24 tokens, not streamed."""
    return client.chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=24
    )


def test_non_stream_answer_and_usage(greedy):
    choice = greedy.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert greedy.usage.completion_tokens == 24
    assert greedy.usage.prompt_tokens > 5
    assert greedy.id.startswith("chatcmpl-")


def test_stream_equals_non_stream_and_reports_usage(client, model, greedy):
    stream = client.chat.completions.create(
        model=model,
        messages=PROMPT,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens


def test_max_tokens_gives_length_with_exactly_that_many_tokens(client, model):
    for n in (1, 7):
        out = client.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=n, temperature=0
        )
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == n


def test_stop_string_cuts_the_text_before_it(client, model, greedy):
    full = greedy.choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), "the reference answer is too short to pick a stop string from"
    out = client.chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=24, stop=[stop, "\x00never"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == full[: full.index(stop)]
    streamed = client.chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=24, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.index(stop)]


def test_seed_reproduces_a_sampled_answer(client, model):
    def sample(seed):
        return (
            client.chat.completions.create(
                model=model, messages=PROMPT, temperature=1.0, top_p=0.9, seed=seed, max_tokens=16
            )
            .choices[0]
            .message.content
        )

    assert sample(7) == sample(7)
    assert {sample(s) for s in (1, 2, 3)} != {sample(7)}


def test_n_and_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=PROMPT, n=2, max_tokens=6, logprobs=True, top_logprobs=2, seed=3
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 12
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


async def test_async_client_streams(aclient, model, greedy):
    stream = await aclient.chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=24, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == greedy.choices[0].message.content


async def test_async_client_errors(aclient, model):
    with pytest.raises(openai.BadRequestError) as caught:
        await aclient.chat.completions.create(model=model, messages=PROMPT, top_p=0)
    assert caught.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        await aclient.chat.completions.create(model="no-such-model", messages=PROMPT)


BAD_REQUESTS = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"not": {}}},
            }
        },
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(("overrides", "param"), BAD_REQUESTS)
def test_bad_requests_raise_bad_request_naming_the_field(client, model, overrides, param):
    kwargs = {"model": model, "messages": PROMPT, **overrides}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "Traceback" not in caught.value.response.text


def test_wrong_key_is_authentication_error(served, model):
    bad = OpenAI(base_url=served.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.chat.completions.create(model=model, messages=PROMPT)
    assert caught.value.body["code"] == "invalid_api_key"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=PROMPT)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


def test_body_over_the_limit_is_413(client, model):
    huge = [{"role": "user", "content": "x" * (300 * 1024)}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=model, messages=huge)
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("content_type", "data", "status", "code"),
    [
        ("text/plain", b'{"model": "m"}', 415, "unsupported_media_type"),
        ("application/json", b'{"model": "m", "messages": [', 400, "invalid_json"),
    ],
)
def test_raw_http_content_type_and_malformed_json(served, content_type, data, status, code):
    resp = httpx.post(
        f"{served.base_url}/chat/completions",
        content=data,
        headers={"Authorization": f"Bearer {E2E_KEY}", "Content-Type": content_type},
    )
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == code
    assert resp.headers["x-request-id"].startswith("req_")


def test_client_going_away_cancels_the_run_after_the_grace_window(client, model, served):
    stream = client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=900, temperature=0, stream=True
    )
    chunks = iter(stream)
    run_id = [next(chunks) for _ in range(4)][-1].id
    # NOTE: the tiny model writes its whole context in under a second, less than the grace
    # window: the worker is paused so that only the gateway's cancel can end the run
    worker = served.worker_process()
    worker.send_signal(signal.SIGSTOP)
    try:
        stream.close()
        gone_at = time.monotonic()

        def ended():
            run = client.chat.completions.retrieve(run_id)
            return run if run.status != "in_progress" else None

        run = until_sync(ended, "the run to end", within=15)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert run.status == "cancelled"
    assert run.choices[0].finish_reason is None  # cut short, not stopped by the model
    assert time.monotonic() - gone_at >= DISCONNECT_GRACE * 0.9  # it waited for a resume

    def idle() -> dict | None:
        stats = httpx.get(f"{served.worker_url()}/v1/stats").json()
        return None if stats["running"] or stats["waiting"] else stats

    stats = until_sync(idle, "the worker to go idle")
    assert stats["kv_blocks_used"] == 0
