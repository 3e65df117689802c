"""The legacy Completions API (`POST /v1/completions`) with one prompt: its parser (each
refusal names its field), its renderer (checked against the `openai` SDK's own `Completion`
type), the upstream chunk reader, the worker API's raw `prompt`, and the route through the
real app on a scripted upstream: stream and not, resume, retrieve, cancel, idempotency."""

from __future__ import annotations

import orjson
import pytest
import tomlkit
from openai.types import Completion

from adapters.completion_chunks import completion_chunk_events
from adapters.events import Finish, TextDelta, Usage
from adapters.openai_upstream import upstream_completion_body
from adapters.pool_continuation import continued_from_text
from gateway.completions.render import CompletionRenderer, completion_object, replayed_chunks
from gateway.completions.request import CompletionParams, parse_completion_request
from gateway.http.errors import APIError
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, gateway_app, sse_events
from tests.support.waiting import until
from wire.api import BadRequest
from wire.generate_body import GenerateRequest, parse_generate
from wire.sampling_params import SamplingParams

PIECES = ["Once", " upon", " a", " time"]
CHAT_BODY = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}]}
CHUNK_KEYS = {"id", "object", "created", "model", "choices"}


def body(**extra) -> dict:
    return {"model": "scripted", "prompt": "Once upon a time"} | extra


def parsed(sent: dict) -> tuple:
    """The request and answer parameters of a one-prompt body."""
    ((chat, params),) = parse_completion_request(sent).runs()
    return chat, params


# -- the request -----------------------------------------------------------------------------


def test_a_string_prompt_becomes_a_raw_prompt_with_openais_defaults():
    chat, params = parsed(body())
    assert chat.prompt == "Once upon a time"
    assert chat.messages == []
    assert chat.max_tokens == 16  # the legacy default
    assert (chat.n, chat.stream, chat.logprobs, chat.top_logprobs) == (1, False, False, 0)
    assert (params.n, params.include_usage) == (1, False)


def test_the_shared_fields_and_an_integer_logprobs_are_mapped():
    chat, params = parsed(
        body(
            prompt=["one prompt"],
            max_tokens=5,
            temperature=0.5,
            top_p=0.9,
            n=3,
            stop="\n",
            logprobs=2,
            seed=7,
            best_of=3,
            echo=False,
            suffix="",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat.prompt == "one prompt"
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.n) == (5, 0.5, 0.9, 3)
    assert (chat.stop, chat.logprobs, chat.top_logprobs, chat.seed) == (["\n"], True, 2, 7)
    assert (params.n, params.include_usage) == (3, True)
    chat, _ = parsed(body(logprobs=0))
    assert (chat.logprobs, chat.top_logprobs) == (True, 0)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"best_of": "2"}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"n": 0}, "n"),
        ({"stop": 5}, "stop"),
        ({"model": None}, "model"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_each_refusal_is_a_400_naming_its_field(extra, param):
    with pytest.raises(APIError) as caught:
        parse_completion_request(body() | extra)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["param"] == param


# -- the renderer ----------------------------------------------------------------------------

CHAT_COMPLETION = {
    "id": "cmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "scripted",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi there"},
            "logprobs": {
                "content": [
                    {
                        "token": "Hi",
                        "logprob": -0.1,
                        "top_logprobs": [{"token": "Hi", "logprob": -0.1}],
                    },
                    {"token": " there", "logprob": -0.2, "top_logprobs": []},
                ]
            },
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}


def test_the_final_object_is_the_sdks_completion():
    obj = completion_object(orjson.dumps(CHAT_COMPLETION), CompletionParams(1, False))
    completion = Completion.model_validate(obj)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == "Hi there"
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].logprobs.tokens == ["Hi", " there"]
    assert completion.choices[0].logprobs.token_logprobs == [-0.1, -0.2]
    assert completion.choices[0].logprobs.top_logprobs == [{"Hi": -0.1}, {}]
    assert completion.choices[0].logprobs.text_offset == [0, 2]
    assert completion.usage.total_tokens == 6


def test_replayed_chunks_are_text_completion_chunks_that_add_up():
    replayed = replayed_chunks(orjson.dumps(CHAT_COMPLETION), CompletionParams(1, True))
    chunks = [orjson.loads(c) for c in replayed]
    assert all(set(c) >= CHUNK_KEYS and c["object"] == "text_completion" for c in chunks)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == "Hi there"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    for chunk in chunks:  # the SDK reads each chunk as a Completion
        Completion.model_construct(**chunk)
        for choice in chunk["choices"]:
            assert set(choice) == {"text", "index", "logprobs", "finish_reason"}


def test_a_role_chunk_renders_nothing_and_an_error_passes_as_is():
    renderer = CompletionRenderer(CompletionParams(1, False))
    delta = {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    role = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role["choices"] = [choice]
    assert renderer.chunk(orjson.dumps(role)) is None
    error = orjson.dumps({"error": {"message": "x", "code": "y"}})
    assert renderer.chunk(error) == error


# -- an upstream's legacy chunks, the worker API's raw prompt ---------------------------------


def test_upstream_legacy_chunks_become_events():
    chunk = {
        "object": "text_completion",
        "choices": [
            {
                "text": "Hi",
                "index": 1,
                "logprobs": {
                    "tokens": ["Hi"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{"Hi": -0.5, "Ho": -1.5}],
                    "text_offset": [0],
                },
                "finish_reason": None,
            },
            {"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    text, finish, usage = completion_chunk_events(chunk, n=2)
    assert isinstance(text, TextDelta) and (text.text, text.index) == ("Hi", 1)
    assert [t["token"] for t in text.logprobs[0]["top_logprobs"]] == ["Hi", "Ho"]
    assert finish == Finish("stop", 0)
    assert usage == Usage(3, 1)
    with pytest.raises(ValueError):
        completion_chunk_events({"choices": [{"text": "x", "index": 2}]}, n=2)


def test_the_upstream_body_is_a_legacy_completion():
    chat, _ = parsed(body(logprobs=3, max_tokens=4, stop=["x"]))
    sent = upstream_completion_body(chat, "up")
    assert sent["prompt"] == "Once upon a time" and "messages" not in sent
    assert (sent["logprobs"], sent["max_tokens"], sent["stop"]) == (3, 4, ["x"])
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_a_raw_prompt_is_continued_elsewhere_by_growing_the_prompt():
    chat, _ = parsed(body(max_tokens=10))
    moved = continued_from_text(chat, " there was", 3)
    assert (moved.prompt, moved.messages) == ("Once upon a time there was", [])
    assert (moved.max_tokens, moved.continue_final_message) == (7, False)


def test_the_worker_body_carries_a_raw_prompt_in_place_of_messages():
    sent = orjson.loads(GenerateRequest("r", [], SamplingParams(), prompt="Once").to_json())
    assert sent["prompt"] == "Once" and "messages" not in sent
    parsed = parse_generate(sent)
    assert (parsed.prompt, parsed.messages) == ("Once", [])
    with pytest.raises(BadRequest) as caught:
        parse_generate(sent | {"messages": [{"role": "user", "content": "Hi"}]})
    assert caught.value.param == "prompt"
    with pytest.raises(BadRequest) as caught:
        parse_generate(sent | {"prompt": ""})
    assert caught.value.param == "prompt"


# -- the route -------------------------------------------------------------------------------


async def make_client(aiohttp_client, store_settings, script=None, **settings):
    adapter = ScriptedAdapter("scripted", script or text_script(PIECES))
    app = gateway_app(adapters=[adapter], **store_settings, **settings)
    return await aiohttp_client(app), adapter


def payloads(raw: bytes) -> list:
    return [e.data if e.data == "[DONE]" else orjson.loads(e.data) for e in sse_events(raw)]


async def test_not_streamed_the_answer_is_a_text_completion(aiohttp_client, store_settings):
    client, adapter = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/completions", json=body(), headers=AUTH)
    assert resp.status == 200
    completion = Completion.model_validate(await resp.json())
    assert completion.id.startswith("cmpl-")
    assert completion.choices[0].text == "".join(PIECES)
    assert completion.usage is not None
    (sent,) = adapter.requests
    assert (sent.prompt, sent.messages, sent.max_tokens) == ("Once upon a time", [], 16)


async def test_a_stream_is_text_deltas_usage_and_done(aiohttp_client, store_settings):
    client, _ = await make_client(aiohttp_client, store_settings)
    options = {"include_usage": True}
    resp = await client.post(
        "/v1/completions", json=body(stream=True, stream_options=options), headers=AUTH
    )
    assert resp.status == 200
    run_id = resp.headers["x-sluice-run-id"]
    raw = await resp.read()
    events = payloads(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == run_id for c in chunks)
    texts = [ch["text"] for c in chunks for ch in c["choices"] if ch["text"]]
    assert texts == PIECES
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    # resume after the second event: the rest, in the same shape, under the same ids
    ids = [int(line[4:]) for line in raw.split(b"\n") if line.startswith(b"id: ")]
    resumed = await client.get(
        f"/v1/completions/{run_id}",
        params={"stream": "true"},
        headers=AUTH | {"Last-Event-ID": str(ids[1])},
    )
    assert payloads(await resumed.read()) == events[2:]


async def test_retrieve_and_cancel_answer_the_text_completion(aiohttp_client, store_settings):
    client, _ = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/completions", json=body(), headers=AUTH)
    run_id = (await resp.json())["id"]
    got = await (await client.get(f"/v1/completions/{run_id}", headers=AUTH)).json()
    assert got["object"] == "text_completion" and got["status"] == "completed"
    assert got["choices"][0]["text"] == "".join(PIECES)
    cancelled = await client.post(f"/v1/completions/{run_id}/cancel", headers=AUTH)
    assert (await cancelled.json())["status"] == "completed"
    chat = await client.post("/v1/chat/completions", json=CHAT_BODY, headers=AUTH)
    chat_id = (await chat.json())["id"]
    missing = await client.get(f"/v1/completions/{chat_id}", headers=AUTH)
    assert missing.status == 404


async def test_an_idempotency_key_replays_the_same_completion(aiohttp_client, store_settings):
    client, adapter = await make_client(aiohttp_client, store_settings)
    headers = AUTH | {"Idempotency-Key": "legacy-1"}
    first = await (await client.post("/v1/completions", json=body(), headers=headers)).json()
    again = await client.post("/v1/completions", json=body(), headers=headers)
    assert (await again.json())["id"] == first["id"]
    assert len(adapter.requests) == 1
    other = await client.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
    assert other.status != 200  # the key belongs to a legacy completion's body


async def test_a_refusal_names_the_legacy_field(aiohttp_client, store_settings):
    client, _ = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/completions", json=body(suffix="x"), headers=AUTH)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "suffix"


async def test_a_dropped_stream_cancels_its_run(aiohttp_client, store_settings):
    script = text_script([f"t{i} " for i in range(200)], delay=0.02)
    client, adapter = await make_client(aiohttp_client, store_settings, script, disconnect_grace=0)
    resp = await client.post("/v1/completions", json=body(stream=True), headers=AUTH)
    run_id = resp.headers["x-sluice-run-id"]
    await resp.content.readuntil(b"t1 ")
    resp.close()
    await until(lambda: adapter.aborted, "the disconnect to reach the adapter")
    assert list(adapter.aborted.values()) == [True]

    async def ended() -> dict | None:
        got = await (await client.get(f"/v1/completions/{run_id}", headers=AUTH)).json()
        return got if got["status"] != "in_progress" else None

    assert (await until(ended, "the run to end"))["status"] == "cancelled"


async def test_the_legacy_default_stays_within_a_tenants_max_tokens_cap(aiohttp_client, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps({"tenants": {"capped": {"max_tokens": 8}}}), encoding="utf-8")
    key, _ = create_key(path, "capped")
    adapter = ScriptedAdapter("scripted", text_script(PIECES))
    client = await aiohttp_client(gateway_app(adapters=[adapter], tenants=str(path), api_key=[]))
    headers = {"Authorization": f"Bearer {key}"}
    resp = await client.post("/v1/completions", json=body(), headers=headers)
    assert resp.status == 200
    assert adapter.requests[0].max_tokens == 8  # not the legacy 16, which the cap would refuse
    resp = await client.post("/v1/completions", json=body(max_tokens=9), headers=headers)
    assert (await resp.json())["error"]["param"] == "max_tokens"
