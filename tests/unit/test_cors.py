"""CORS through the real app: an allowed origin's preflight and answers (streams included)
carry what a browser needs; an unknown origin, or a gateway with none configured, gets no CORS
headers at all."""

from __future__ import annotations

from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app

PAGE = "https://chat.example"


async def make_client(aiohttp_client, origins: list[str]):
    adapter = ScriptedAdapter("scripted", text_script(["Hello", " there"]))
    return await aiohttp_client(gateway_app(adapters=[adapter], cors_origin=origins))


def preflight_headers(origin: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }


async def test_an_allowed_origins_preflight_is_answered_without_a_key(aiohttp_client):
    client = await make_client(aiohttp_client, [PAGE])
    resp = await client.options("/v1/chat/completions", headers=preflight_headers(PAGE))
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(resp.headers["Access-Control-Max-Age"]) > 0


async def test_an_allowed_origins_stream_exposes_the_follow_token(aiohttp_client):
    client = await make_client(aiohttp_client, [PAGE])
    resp = await client.post(
        "/v1/chat/completions", json=chat_body(stream=True), headers={**AUTH, "Origin": PAGE}
    )
    assert resp.status == 200
    await resp.read()
    assert resp.headers["Access-Control-Allow-Origin"] == PAGE
    exposed = {h.strip() for h in resp.headers["Access-Control-Expose-Headers"].split(",")}
    assert {"x-follow-token", "x-request-id", "retry-after"} <= exposed
    assert resp.headers["Vary"] == "Origin"


async def test_errors_reach_an_allowed_origin_too(aiohttp_client):
    client = await make_client(aiohttp_client, [PAGE])
    resp = await client.get("/v1/models", headers={"Origin": PAGE})
    assert resp.status == 401
    assert resp.headers["Access-Control-Allow-Origin"] == PAGE


async def test_an_unknown_origin_gets_no_cors_headers(aiohttp_client):
    client = await make_client(aiohttp_client, [PAGE])
    evil = "https://evil.example"
    refused = await client.options("/v1/chat/completions", headers=preflight_headers(evil))
    answered = await client.get("/v1/models", headers={**AUTH, "Origin": evil})
    assert refused.status >= 400 and answered.status == 200  # no preflight answer for it
    for resp in (refused, answered):
        assert not [h for h in resp.headers if h.lower().startswith("access-control-")]


async def test_no_origin_is_allowed_by_default(aiohttp_client):
    client = await make_client(aiohttp_client, [])
    resp = await client.options("/v1/chat/completions", headers=preflight_headers(PAGE))
    assert resp.status >= 400
    assert "Access-Control-Allow-Origin" not in resp.headers
    assert "Vary" not in resp.headers


async def test_a_star_allows_any_origin_by_name(aiohttp_client):
    client = await make_client(aiohttp_client, ["*"])
    resp = await client.get("/v1/models", headers={**AUTH, "Origin": PAGE})
    assert resp.headers["Access-Control-Allow-Origin"] == PAGE
