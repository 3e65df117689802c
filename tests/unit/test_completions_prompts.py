"""The legacy Completions API with several prompts, token ids and `echo`: the parser, the
renderer's merged choice indexes and echoed prompt, and the route through the real app on a
scripted upstream: the answer merged as OpenAI merges it (stream and not), each prompt its own
run (ids in `x-sluice-run-ids`, each retrievable), and no run left going when one fails, when a
later one is refused, or when the client goes away."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import tomlkit
from openai.types import Completion

from adapters.base import BackendFailed, BackendRejected
from adapters.events import Finish, TextDelta, Usage
from adapters.openai_upstream import upstream_completion_body
from gateway.app_keys import LEDGER
from gateway.completions.render import CompletionRenderer, completion_object
from gateway.completions.request import MAX_PROMPTS, CompletionParams, parse_completion_request
from gateway.http.errors import APIError
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter
from tests.support.gateway import AUTH, gateway_app, stream_payloads
from tests.support.waiting import until
from wire.api import BadRequest
from wire.generate_body import GenerateRequest, parse_generate
from wire.sampling_params import SamplingParams


def body(**extra) -> dict:
    return {"model": "scripted", "prompt": ["Once", "Twice"]} | extra


def echo_script(request):
    """Answers each prompt with its own text then "!", as two tokens per choice."""
    first = request.prompt if isinstance(request.prompt, str) else f"ids{len(request.prompt)}"
    steps = []
    for i in range(request.n):
        steps += [TextDelta(f"<{first}>", i), TextDelta("!", i), Finish("length", i)]
    return [*steps, Usage(3, 2 * request.n)]


def slow_script(request):
    """A prompt "fail" fails after its first token; "refused" is refused before any; "quick"
    answers at once; any other streams slowly for long."""
    if request.prompt == "fail":
        return [TextDelta("f"), 0.05, BackendFailed("boom")]
    if request.prompt == "quick":
        return echo_script(request)
    if request.prompt == "refused":
        return [0.05, BackendRejected("bad prompt", "prompt")]
    return [step for i in range(400) for step in (0.02, TextDelta(f"t{i} "))]


async def make_client(aiohttp_client, store_settings, script=echo_script, **settings):
    adapter = ScriptedAdapter("scripted", script)
    app = gateway_app(adapters=[adapter], **store_settings, **settings)
    return await aiohttp_client(app), adapter


def run_ids(resp) -> list[str]:
    return resp.headers["x-sluice-run-ids"].split(", ")


# -- the request -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("one", ["one"]),
        (["a", "b", "c"], ["a", "b", "c"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_each_prompt_is_a_run_of_its_own(prompt, expected):
    call = parse_completion_request({"model": "m", "prompt": prompt, "n": 2})
    runs = call.runs()
    assert [chat.prompt for chat, _ in runs] == expected
    assert [params.first_choice for _, params in runs] == [2 * i for i in range(len(expected))]
    assert all(chat.messages == [] and chat.n == 2 for chat, _ in runs)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": ["p"] * (MAX_PROMPTS + 1)}, "prompt"),
        ({"echo": "yes"}, "echo"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"echo": True, "prompt": [1, 2]}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_each_refusal_is_a_400_naming_its_field(extra, param):
    with pytest.raises(APIError) as caught:
        parse_completion_request(body() | extra)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["param"] == param


def test_echo_keeps_each_prompts_text():
    runs = parse_completion_request(body(echo=True)).runs()
    assert [params.echo for _, params in runs] == ["Once", "Twice"]
    assert CompletionParams.from_meta(runs[1][1].to_meta()) == runs[1][1]


def test_token_ids_travel_as_ids_to_a_worker_and_an_upstream():
    ((chat, _),) = parse_completion_request(body(prompt=[5, 6.0, 7])).runs()
    assert chat.prompt == [5, 6, 7]
    assert upstream_completion_body(chat, "up")["prompt"] == [5, 6, 7]
    sent = orjson.loads(GenerateRequest("r", [], SamplingParams(), prompt=chat.prompt).to_json())
    assert parse_generate(sent).prompt == (5, 6, 7)
    for bad in ([], [1, -1], [1, True], ["a"]):
        with pytest.raises(BadRequest) as caught:
            parse_generate(sent | {"prompt": bad})
        assert caught.value.param == "prompt"


# -- the renderer ----------------------------------------------------------------------------


def test_a_later_prompts_choices_are_offset_and_echo_comes_first():
    renderer = CompletionRenderer(CompletionParams(2, False, index=1, echo="P"))
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    roles = [{"index": i, "delta": {"role": "assistant", "content": ""}} for i in (0, 1)]
    echoed = orjson.loads(renderer.chunk(orjson.dumps(head | {"choices": roles})))
    assert [(c["index"], c["text"]) for c in echoed["choices"]] == [(2, "P"), (3, "P")]
    text = {"index": 1, "delta": {"content": "x"}, "finish_reason": None}
    rendered = orjson.loads(renderer.chunk(orjson.dumps(head | {"choices": [text]})))
    assert [(c["index"], c["text"]) for c in rendered["choices"]] == [(3, "x")]
    resumed = CompletionRenderer(CompletionParams(2, False, index=1, echo="P"), echo=False)
    assert resumed.chunk(orjson.dumps(head | {"choices": roles})) is None


def test_the_final_object_echoes_and_offsets():
    completion = {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"content": " there"}, "finish_reason": "stop"}],
    }
    obj = completion_object(orjson.dumps(completion), CompletionParams(1, False, 3, "Hi"))
    assert [(c["index"], c["text"]) for c in obj["choices"]] == [(3, "Hi there")]


# -- the route -------------------------------------------------------------------------------


async def test_not_streamed_the_runs_merge_as_openais(aiohttp_client, store_settings, tmp_path):
    usage_file = tmp_path / "usage.jsonl"
    client, adapter = await make_client(aiohttp_client, store_settings, usage_file=str(usage_file))
    resp = await client.post("/v1/completions", json=body(n=2), headers=AUTH)
    assert resp.status == 200, await resp.text()
    completion = Completion.model_validate(await resp.json())
    texts = [(c.index, c.text) for c in completion.choices]
    assert texts == [(0, "<Once>!"), (1, "<Once>!"), (2, "<Twice>!"), (3, "<Twice>!")]
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (6, 8)
    first, second = run_ids(resp)
    assert completion.id == first == resp.headers["x-sluice-run-id"]
    assert sorted(r.prompt for r in adapter.requests) == ["Once", "Twice"]
    got = await (await client.get(f"/v1/completions/{second}", headers=AUTH)).json()
    assert [c["index"] for c in got["choices"]] == [2, 3] and got["status"] == "completed"

    async def recorded() -> list[str] | None:  # each run leaves its own usage record
        ids = sorted([r.run_id async for r in client.app[LEDGER].read()])
        return ids if len(ids) == 2 else None

    assert await until(recorded, "both runs' usage records") == sorted([first, second])


async def test_a_stream_interleaves_the_runs_then_one_usage_and_done(
    aiohttp_client, store_settings
):
    client, _ = await make_client(aiohttp_client, store_settings)
    sent = body(stream=True, stream_options={"include_usage": True}, echo=True)
    resp = await client.post("/v1/completions", json=sent, headers=AUTH)
    assert resp.status == 200
    raw = await resp.read()
    events = stream_payloads(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    usages = [c for c in chunks if c.get("usage")]
    assert usages == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    by_index: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    assert by_index == {0: "Once<Once>!", 1: "Twice<Twice>!"}
    ids = [int(line[4:]) for line in raw.split(b"\n") if line.startswith(b"id: ")]
    assert ids == list(range(1, len(chunks) + 1))


async def test_token_ids_reach_the_backend_as_ids(aiohttp_client, store_settings):
    client, adapter = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/completions", json=body(prompt=[5, 6, 7]), headers=AUTH)
    assert (await resp.json())["choices"][0]["text"] == "<ids3>!"
    assert adapter.requests[0].prompt == [5, 6, 7]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_idempotency_key_finds_every_run_again(aiohttp_client, store_settings, stream):
    client, adapter = await make_client(aiohttp_client, store_settings)
    headers = AUTH | {"Idempotency-Key": "several-1"}
    first = await client.post("/v1/completions", json=body(stream=stream), headers=headers)
    answer = await first.read()
    again = await client.post("/v1/completions", json=body(stream=stream), headers=headers)
    assert run_ids(again) == run_ids(first) and len(adapter.requests) == 2
    assert again.headers["idempotent-replayed"] == "true"
    if not stream:
        assert await again.json() == orjson.loads(answer)
    other = await client.post("/v1/completions", json=body(prompt=["x", "y"]), headers=headers)
    assert other.status == 422  # the same key, another body


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_run_cancels_the_others(aiohttp_client, store_settings, stream):
    client, adapter = await make_client(aiohttp_client, store_settings, slow_script)
    resp = await client.post(
        "/v1/completions", json=body(prompt=["slow", "fail"], stream=stream), headers=AUTH
    )
    if stream:
        events = stream_payloads(await resp.read())
        assert events[-1] == "[DONE]" and "error" in events[-2]
    else:
        assert resp.status >= 500 and "error" in await resp.json()
    ids = run_ids(resp)
    assert await until(lambda: _all_ended(client, ids), "both runs to end") == [
        "cancelled",
        "failed",
    ]
    assert list(adapter.aborted.values()) == [True]  # the slow run's upstream was stopped


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_its_backend_refuses_is_the_calls_400(aiohttp_client, store_settings, stream):
    client, _ = await make_client(aiohttp_client, store_settings, slow_script)
    sent = body(prompt=["slow", "refused"], stream=stream)
    resp = await client.post("/v1/completions", json=sent, headers=AUTH)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "prompt"
    ids = run_ids(resp)
    assert await until(lambda: _all_ended(client, ids), "both runs to end") == [
        "cancelled",
        "failed",  # refused by its backend
    ]


async def test_a_dropped_stream_cancels_every_run_at_once(aiohttp_client, store_settings):
    client, adapter = await make_client(
        aiohttp_client, store_settings, slow_script, disconnect_grace=300
    )
    resp = await client.post(
        "/v1/completions", json=body(prompt=["a", "b"], stream=True), headers=AUTH
    )
    ids = run_ids(resp)
    await resp.content.readuntil(b"t1 ")
    resp.close()
    await until(lambda: len(adapter.aborted) == 2, "the disconnect to stop both runs")
    assert await until(lambda: _all_ended(client, ids), "both runs to end") == ["cancelled"] * 2


async def test_a_dropped_call_cancels_every_run_at_once(aiohttp_client, store_settings):
    client, adapter = await make_client(
        aiohttp_client, store_settings, slow_script, disconnect_grace=300
    )
    call = asyncio.ensure_future(client.post("/v1/completions", json=body(), headers=AUTH))
    await until(lambda: len(adapter.requests) == 2, "both runs to start")
    call.cancel()
    await until(lambda: len(adapter.aborted) == 2, "the disconnect to stop both runs")


async def test_a_later_prompt_refused_leaves_no_run_going(aiohttp_client, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps({"tenants": {"one": {"max_concurrent": 1}}}), encoding="utf-8")
    key, _ = create_key(path, "one")
    adapter = ScriptedAdapter("scripted", slow_script)
    client = await aiohttp_client(gateway_app(adapters=[adapter], tenants=str(path), api_key=[]))
    headers = {"Authorization": f"Bearer {key}"}
    resp = await client.post("/v1/completions", json=body(), headers=headers)
    assert resp.status == 429

    async def slot_back() -> bool:  # the first run was cancelled, and its slot given back
        again = await client.post("/v1/completions", json=body(prompt="quick"), headers=headers)
        return again.status == 200

    await until(slot_back, "the first run's concurrency slot to come back")


async def _statuses(client, ids: list[str]) -> list[str]:
    got = [await (await client.get(f"/v1/completions/{i}", headers=AUTH)).json() for i in ids]
    return [g["status"] for g in got]


async def _all_ended(client, ids: list[str]) -> list[str] | None:
    statuses = await _statuses(client, ids)
    return None if "in_progress" in statuses else statuses
