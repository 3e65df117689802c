"""The adapters' `count_tokens` against small stand-in servers: our worker's `POST /v1/count`
(a worker without the route, or one that cannot answer, is no count; its 400 is the request's
own), and an upstream's `/tokenize` at its server root."""

from __future__ import annotations

import pytest
from aiohttp import web

from adapters.base import BackendRejected, TokenCount
from adapters.openai_upstream import OpenAIUpstreamAdapter
from adapters.requests import ChatRequest, Message
from adapters.worker_client import WorkerAdapter
from wire.api import API_VERSION, error_body

ASKED = ChatRequest("tiny", [Message("user", "Hi")], max_tokens=1)


async def serving(aiohttp_server, routes: dict[str, web.Response]):
    """A server answering each path with its response (and /v1/model as a worker of this API
    version); what it was asked, by path."""
    asked: dict[str, list[dict]] = {}

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/v1/model":
            return web.json_response({"id": "tiny", "api_version": API_VERSION})
        asked.setdefault(request.path, []).append(await request.json())
        return routes[request.path]

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = await aiohttp_server(app)
    return asked, f"http://127.0.0.1:{server.port}"


@pytest.mark.parametrize(
    "answer",
    [
        web.json_response({"error": "no such route"}, status=404),  # an older worker
        web.json_response({"input_tokens": True}),  # not a count
        web.json_response({"error": "loading"}, status=503),
    ],
)
async def test_a_worker_that_cannot_count_is_no_count(aiohttp_server, answer):
    asked, url = await serving(aiohttp_server, {"/v1/count": answer})
    worker = WorkerAdapter(url)
    await worker.start()
    try:
        assert await worker.count_tokens(ASKED, "count-1") is None
    finally:
        await worker.close()
    assert asked["/v1/count"][0]["messages"] == [{"role": "user", "content": "Hi"}]


async def test_a_workers_count_and_its_refusal(aiohttp_server):
    refusal = error_body("bad tool", "invalid_value", "tools[0].function.name")
    for answer, expected in (
        (web.json_response({"input_tokens": 17}), TokenCount(17, "worker")),
        (web.json_response(refusal, status=400), "tools[0].function.name"),
    ):
        _, url = await serving(aiohttp_server, {"/v1/count": answer})
        worker = WorkerAdapter(url)
        await worker.start()
        try:
            if isinstance(expected, TokenCount):
                assert await worker.count_tokens(ASKED, "count-1") == expected
            else:
                with pytest.raises(BackendRejected) as info:
                    await worker.count_tokens(ASKED, "count-1")
                assert info.value.param == expected
        finally:
            await worker.close()


async def test_an_upstream_is_asked_at_its_server_root(aiohttp_server):
    answer = web.json_response({"count": 9, "max_model_len": 4096, "tokens": []})
    asked, url = await serving(aiohttp_server, {"/tokenize": answer})
    upstream = OpenAIUpstreamAdapter("m", f"{url}/v1", upstream_model="org/m")
    await upstream.start()
    try:
        assert await upstream.count_tokens(ASKED, "count-1") == TokenCount(9, "upstream")
        legacy = ChatRequest("m", [], prompt="raw text")  # a raw prompt: not the chat form
        assert await upstream.count_tokens(legacy, "count-2") is None
    finally:
        await upstream.close()
    assert asked["/tokenize"] == [
        {"model": "org/m", "messages": [{"role": "user", "content": "Hi"}]}
    ]
