"""A run's follow token through the real app (in-process store and a real Redis): what it
opens (that run's GET routes), what it does not (other runs, other tenants, POST, cancel, other
routes), and how a finished stream ends for a browser (a `retry:` hint, then 204 at the end)."""

from __future__ import annotations

from gateway.app_keys import FOLLOW_TOKENS
from gateway.http.follow_tokens import FollowTokens
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, add_tenant, chat_body, gateway_app, sse_events, stream_text

PIECES = [f"{i}:é " for i in range(12)]
OTHER_TENANT = {"Authorization": "Bearer sk-sluice-other-tenant"}


async def make_client(aiohttp_client, store_settings, **settings):
    adapter = ScriptedAdapter("scripted", text_script(PIECES, delay=0.005))
    app = gateway_app(adapters=[adapter], **store_settings, **settings)
    add_tenant(app, "other", "sk-sluice-other-tenant")
    return await aiohttp_client(app)


async def finished_run(client, headers=AUTH) -> tuple[str, str, list]:
    """(run id, its x-follow-token, its events) of a streamed run read to its end."""
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=headers)
    assert resp.status == 200
    events = sse_events(await resp.read())
    return events[0].json()["id"], resp.headers["x-follow-token"], events


def run_url(run_id: str) -> str:
    return f"/v1/chat/completions/{run_id}"


def texts(events) -> str:
    return stream_text([e.json() for e in events if e.data != "[DONE]"])


async def test_the_token_alone_reads_and_resumes_its_run(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    run_id, token, events = await finished_run(client)
    whole = await client.get(run_url(run_id), params={"stream": "true", "token": token})
    assert whole.status == 200
    replay = sse_events(await whole.read())
    assert [(e.id, e.data) for e in replay] == [(e.id, e.data) for e in events]
    resumed = await client.get(
        run_url(run_id), params={"stream": "true", "token": token, "starting_after": "3"}
    )
    rest = sse_events(await resumed.read())
    assert int(rest[0].id) == 4 and texts(events[:3] + rest) == "".join(PIECES)
    stored = await client.get(run_url(run_id), params={"token": token})
    body = await stored.json()
    assert body["status"] == "completed" and body["follow_token"] == token  # never a longer one
    assert stored.headers["x-follow-token"] == token


async def test_the_stored_object_carries_a_token_for_its_tenant(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    run_id, _, _ = await finished_run(client)
    body = await (await client.get(run_url(run_id), headers=AUTH)).json()
    assert client.app[FOLLOW_TOKENS].tenant_of(body["follow_token"], run_id) == "default"


async def test_a_non_streaming_answer_carries_the_header(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    run_id = (await resp.json())["id"]
    token = resp.headers["x-follow-token"]
    assert (await client.get(run_url(run_id), params={"token": token})).status == 200


async def test_the_token_opens_nothing_else(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    run_id, token, _ = await finished_run(client)
    other_id, _, _ = await finished_run(client)
    refused = {
        "another run": await client.get(run_url(other_id), params={"token": token}),
        "cancel": await client.post(f"{run_url(run_id)}/cancel", params={"token": token}),
        "a new run": await client.post(
            "/v1/chat/completions", params={"token": token}, json=chat_body()
        ),
        "the models": await client.get("/v1/models", params={"token": token}),
        "a forged token": await client.get(run_url(run_id), params={"token": token[:-2] + "xx"}),
    }
    for what, resp in refused.items():
        assert resp.status == 401, what
        assert (await resp.json())["error"]["code"] in ("invalid_follow_token", "invalid_api_key")


async def test_another_tenants_run_is_a_404_even_with_a_valid_token(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    run_id, _, _ = await finished_run(client)
    # a token the server signed, for this run id, but for the other tenant
    token = client.app[FOLLOW_TOKENS].issue(run_id, "other")
    resp = await client.get(run_url(run_id), params={"token": token})
    assert resp.status == 404


async def test_an_expired_token_is_refused(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    run_id, _, _ = await finished_run(client)
    secret = client.app[FOLLOW_TOKENS].secret
    past = FollowTokens(secret, ttl=60, clock=lambda: 1_000_000.0).issue(run_id, "default")
    resp = await client.get(run_url(run_id), params={"token": past})
    assert resp.status == 401
    assert (await resp.json())["error"]["param"] == "token"


async def test_replicas_sharing_redis_accept_each_others_tokens(aiohttp_client, store_settings):
    first = await make_client(aiohttp_client, store_settings)
    second = await make_client(aiohttp_client, store_settings)
    run_id, token, _ = await finished_run(first)
    resp = await second.get(run_url(run_id), params={"token": token})
    if store_settings:  # Redis: one secret for both
        assert resp.status == 200
    else:  # two in-process stores: neither the run nor the secret is shared
        assert resp.status in (401, 404)


async def test_streams_open_with_a_retry_hint(aiohttp_client, store_settings):
    client = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    raw = await resp.read()
    assert raw.startswith(b"retry: ")
    assert sse_events(raw)[0].retry > 0


async def test_a_resume_at_or_after_the_end_of_a_finished_run_is_204(
    aiohttp_client, store_settings
):
    client = await make_client(aiohttp_client, store_settings)
    run_id, token, events = await finished_run(client)
    last = int(events[-2].id)  # the last event before [DONE]
    for after, header in ((last, False), (last, True), (last + 5, False)):
        params = {"stream": "true", "token": token}
        headers = {}
        if header:
            headers["Last-Event-ID"] = str(after)
        else:
            params["starting_after"] = str(after)
        resp = await client.get(run_url(run_id), params=params, headers=headers)
        assert resp.status == 204, (after, header)
        assert await resp.read() == b""
    before = await client.get(
        run_url(run_id), params={"stream": "true", "token": token, "starting_after": last - 1}
    )
    assert before.status == 200 and len(sse_events(await before.read())) == 2  # one, [DONE]


async def test_last_event_id_wins_over_the_urls_starting_after(aiohttp_client, store_settings):
    """What an EventSource opened on `...&starting_after=2` sends when it reconnects."""
    client = await make_client(aiohttp_client, store_settings)
    run_id, token, _ = await finished_run(client)
    resp = await client.get(
        run_url(run_id),
        params={"stream": "true", "token": token, "starting_after": "2"},
        headers={"Last-Event-ID": "5"},
    )
    assert int(sse_events(await resp.read())[0].id) == 6


async def test_other_tenant_key_with_this_token_is_not_mixed(aiohttp_client, store_settings):
    """A credential in the header is what counts: the token beside it is not looked at."""
    client = await make_client(aiohttp_client, store_settings)
    run_id, token, _ = await finished_run(client)
    resp = await client.get(run_url(run_id), params={"token": token}, headers=OTHER_TENANT)
    assert resp.status == 404
