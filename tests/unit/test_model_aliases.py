"""Model aliases through the real app over scripted targets (design §6, docs/routing.md): the
alias is listed and probed as a model, the response names the target that served and the
`x-sluice-route` header why the others were passed over; tenants' allow-lists, readiness and
flow control's sheds each pass a target over; a config naming what nobody serves fails the
start."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from adapters.base import BackendUnavailable
from adapters.events import TextDelta
from common.config import ConfigError
from gateway.app_keys import AUTH as AUTH_KEY
from gateway.app_keys import LEDGER, RUNS
from gateway.handlers.answers import served_model
from policies.tenants import Tenant, single_tenant
from policies.tenants_sharing import Sharing
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events, stream_payloads
from tests.support.waiting import until

ALIAS = {"chat": {"targets": ["a", "b"]}}
HOLD = 30.0  # a pause no test waits out


def target(name: str, *pieces: str, **options) -> ScriptedAdapter:
    return ScriptedAdapter(name, text_script(list(pieces) or [f"from {name}"]), **options)


async def make_client(aiohttp_client, *adapters, models=None, **settings):
    app = gateway_app(adapters=list(adapters), models=models or ALIAS, **settings)
    return await aiohttp_client(app)


async def chat(client, headers=AUTH, **body):
    return await client.post(
        "/v1/chat/completions", json=chat_body("chat", **body), headers=headers
    )


def add_tenant(app, name: str, models: tuple[str, ...], **sharing) -> dict[str, str]:
    """A tenant allowed `models` (globs); its auth headers."""
    auth = app[AUTH_KEY]
    key = f"sk-sluice-{name}-key"
    keys = single_tenant([key], name).tenants[name].keys
    tenant = Tenant(name, models=models, keys=keys, sharing=Sharing(**sharing))
    auth.reload(replace(auth.config, tenants={**auth.config.tenants, name: tenant}))
    return {"Authorization": f"Bearer {key}"}


def waiting(client) -> list:
    return [d for d in client.app[RUNS].drivers.values() if d.phase.name == "WAITING"]


def samples(text: str, name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_the_alias_is_listed_and_ready_while_a_target_is(aiohttp_client):
    client = await make_client(aiohttp_client, target("a", ready=False), target("b"))
    models = await (await client.get("/v1/models", headers=AUTH)).json()
    assert {m["id"] for m in models["data"]} == {"a", "b", "chat"}
    assert (await client.get("/v1/models/chat", headers=AUTH)).status == 200
    ready = await (await client.get("/readyz")).json()
    assert ready["models"] == {"a": False, "b": True, "chat": True}


async def test_the_first_target_serves_and_every_chunk_names_it(aiohttp_client, tmp_path):
    a, b = target("a", "x", "y"), target("b")
    client = await make_client(aiohttp_client, a, b, usage_file=str(tmp_path / "usage.jsonl"))
    resp = await chat(client, stream=True, stream_options={"include_usage": True})
    assert resp.headers["x-sluice-route"] == "a;served"
    payloads = stream_payloads(await resp.read())
    assert {p["model"] for p in payloads if isinstance(p, dict)} == {"a"}
    assert [r.model for r in a.requests] == ["a"] and b.requests == []

    async def record():
        return [r async for r in client.app[LEDGER].read()]

    (usage,) = await until(record, "the run's usage record")
    assert usage.model == "a"  # billed as the model that served


async def test_a_target_not_ready_is_passed_over_and_the_answer_says_so(aiohttp_client):
    client = await make_client(aiohttp_client, target("a", ready=False), target("b"))
    resp = await chat(client)
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == "a;skipped=unavailable, b;served"
    body = await resp.json()
    assert body["model"] == "b"
    assert body["choices"][0]["message"]["content"] == "from b"
    metrics = await (await client.get("/metrics")).text()
    fallbacks = samples(metrics, "sluice_fallbacks_total")
    assert fallbacks[(("alias", "chat"), ("outcome", "fell_back"))] == 1
    assert fallbacks[(("alias", "chat"), ("outcome", "served_first"))] == 0  # known from start
    finished = samples(metrics, "sluice_runs_finished_total")
    assert finished[(("model", "b"), ("reason", "stop"))] == 1


async def test_a_target_that_fails_before_its_first_token_hands_the_stream_to_the_next(
    aiohttp_client,
):
    failing = ScriptedAdapter("a", lambda r: [BackendUnavailable("unreachable")])
    client = await make_client(aiohttp_client, failing, target("b", "one", "two"), ping_interval=5)
    resp = await chat(client, stream=True)
    assert resp.status == 200
    # the stream's headers went out with its first events: the route was known by then
    assert resp.headers["x-sluice-route"] == "a;skipped=unavailable, b;served"
    payloads = stream_payloads(await resp.read())
    assert payloads[0]["model"] == "b" and payloads[-1] == "[DONE]"
    assert "".join(
        c["delta"].get("content") or "" for p in payloads[:-1] for c in p["choices"]
    ) == ("onetwo")


async def test_with_no_target_ready_the_answer_is_a_503_naming_the_alias(aiohttp_client):
    client = await make_client(aiohttp_client, target("a", ready=False), target("b", ready=False))
    resp = await chat(client)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "overloaded"
    assert resp.headers["x-sluice-route"] == "a;skipped=unavailable, b;skipped=unavailable"
    metrics = await (await client.get("/metrics")).text()
    assert samples(metrics, "sluice_fallbacks_total")[(("alias", "chat"), ("outcome", "exhausted"))]


async def test_the_allow_list_applies_to_the_alias_and_to_each_target(aiohttp_client):
    a, b = target("a"), target("b")
    client = await make_client(aiohttp_client, a, b)
    only_b = add_tenant(client.app, "only-b", ("chat", "b"))
    resp = await chat(client, headers=only_b)
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == "a;skipped=not_allowed, b;served"
    assert a.requests == []
    alias_only = add_tenant(client.app, "alias-only", ("chat",))
    resp = await chat(client, headers=alias_only)
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "model_not_allowed"
    targets_only = add_tenant(client.app, "targets-only", ("a", "b"))
    resp = await chat(client, headers=targets_only)
    assert resp.status == 403
    assert "x-sluice-route" not in resp.headers  # refused before any target was looked at


async def test_a_target_whose_queue_sheds_the_run_is_passed_over(aiohttp_client):
    first = True

    def a_script(request):  # the first run holds a's only slot; the rest are quick
        nonlocal first
        steps, first = ([TextDelta("held"), HOLD] if first else text_script(["a"])(request)), False
        return steps

    a = ScriptedAdapter("a", a_script, capacity=1)
    client = await make_client(aiohttp_client, a, target("b"), ping_interval=0.05)
    tight = add_tenant(client.app, "tight", ("*",), max_queued=1)
    holder = await chat(client, headers=tight, stream=True)
    await until(lambda: a.requests, "the first run to hold a's slot")
    queued = asyncio.create_task(chat(client, headers=tight))
    await until(lambda: waiting(client), "the second run to wait in a's queue")
    resp = await chat(client, headers=tight)  # a's queue is full for this tenant: shed there
    assert resp.headers["x-sluice-route"] == "a;skipped=shed, b;served"
    assert (await resp.json())["model"] == "b"
    holder_id = orjson.loads(sse_events(await holder.content.readuntil(b"\n\n"))[0].data)["id"]
    await client.post(f"/v1/chat/completions/{holder_id}/cancel", headers=tight)
    assert (await (await queued).json())["model"] == "a"


async def test_the_responses_api_names_the_target_that_served(aiohttp_client):
    client = await make_client(aiohttp_client, target("a", ready=False), target("b"))
    resp = await client.post("/v1/responses", json={"model": "chat", "input": "Hi"}, headers=AUTH)
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == "a;skipped=unavailable, b;served"
    assert (await resp.json())["model"] == "b"


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ({"chat": {"targets": ["a", "nobody"]}}, "target 'nobody' is not a model any backend"),
        ({"a": {"targets": ["b"]}}, "a backend serves a model of that name"),
    ],
)
async def test_an_alias_over_what_nobody_serves_fails_the_start(models, message):
    app = gateway_app(adapters=[target("a"), target("b")], models=models)
    runner = web.AppRunner(app)
    with pytest.raises(ConfigError) as info:
        await runner.setup()  # the app's start: its backends, then its aliases over them
    assert message in str(info.value)
    await runner.cleanup()


async def test_a_streams_header_tells_the_route_as_it_stood_when_the_stream_began(
    aiohttp_client,
):
    slow = ScriptedAdapter("a", lambda r: [HOLD, TextDelta("late")])
    models = {"chat": {"targets": ["a", "b"], "first_token_timeout": 1.0}}
    client = await make_client(aiohttp_client, slow, target("b"), models=models, ping_interval=0.05)
    resp = await chat(client, stream=True)
    # the headers went out one ping interval in, while a was still being waited for
    assert resp.headers["x-sluice-route"] == "a;trying"
    payloads = stream_payloads(await resp.read())
    assert {p["model"] for p in payloads if isinstance(p, dict)} == {"b"}  # b served after all
    assert list(slow.aborted.values()) == [True]  # its stream was closed at the deadline


def test_a_merged_backlog_names_the_model_its_chunks_name():
    chunk = orjson.dumps({"id": "x", "object": "chat.completion.chunk", "model": "b"})
    assert served_model([(1, chunk, None, 0)], "chat") == "b"
    assert served_model([], "chat") == "chat"


class NoLogprobs(ScriptedAdapter):
    def unsupported_param(self, request) -> str | None:
        return "logprobs" if request.logprobs else None


async def test_a_target_that_cannot_honour_a_parameter_is_passed_over(aiohttp_client):
    a = NoLogprobs("a", text_script(["from a"]))
    client = await make_client(aiohttp_client, a, target("b"))
    resp = await chat(client, logprobs=True)
    assert resp.headers["x-sluice-route"] == "a;skipped=unsupported, b;served"
    assert (await chat(client)).headers["x-sluice-route"] == "a;served"
    models = {"chat": {"targets": ["a"]}}  # an alias over a alone
    client = await make_client(aiohttp_client, NoLogprobs("a", text_script(["x"])), models=models)
    resp = await chat(client, logprobs=True)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", "logprobs")
