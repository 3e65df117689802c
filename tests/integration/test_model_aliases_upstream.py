"""A model alias over scripted OpenAI-compatible servers, over real HTTP: a target whose server
answers 500 or 503 before any token is passed over and the next one serves; a 400 is the
request's own and is not retried."""

from __future__ import annotations

import pytest

from tests.support.gateway import AUTH, chat_body, gateway_app, stream_payloads, stream_text

ERROR = {"error": {"message": "upstream internal detail", "type": "server_error"}}


@pytest.fixture
async def gateway(upstream, aiohttp_client):
    _, url = upstream
    app = gateway_app(
        upstream=[f"{m}={url}" for m in ("first", "second")],
        models={"chat": {"targets": ["first", "second"]}},
        ping_interval=5,
    )
    return await aiohttp_client(app)


@pytest.mark.parametrize(("status", "reason"), [(500, "failed"), (503, "unavailable")])
async def test_a_target_failing_before_its_first_token_hands_the_run_on(
    gateway, upstream, status, reason
):
    state, _ = upstream
    state.status_for["first"] = (status, ERROR)
    resp = await gateway.post(
        "/v1/chat/completions", json=chat_body("chat", stream=True, max_tokens=3), headers=AUTH
    )
    assert resp.status == 200
    assert resp.headers["x-sluice-route"] == f"first;skipped={reason}, second;served"
    payloads = stream_payloads(await resp.read())
    assert stream_text(payloads) == "tok0 tok1 tok2 "
    assert {p["model"] for p in payloads if isinstance(p, dict)} == {"second"}
    assert [r.body["model"] for r in state.records] == ["first", "second"]


async def test_a_refusal_is_not_retried_on_the_next_target(gateway, upstream):
    state, _ = upstream
    state.status_for["first"] = (400, {"error": {"message": "bad", "param": "temperature"}})
    resp = await gateway.post("/v1/chat/completions", json=chat_body("chat"), headers=AUTH)
    assert resp.status == 400
    assert [r.body["model"] for r in state.records] == ["first"]
