"""The safety window through the real gateway (design §3), in front of the scripted
OpenAI-compatible upstream, for two tenants from one tenants file: one with a strict policy,
one with none. What the strict tenant's clients get is checked in every byte sent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tomlkit
from aiohttp import web
from structlog.testing import capture_logs

from gateway.app_keys import AUTH, METRICS, RUNS
from policies.tenants_file import create_key
from testkit.scripted_upstream import sse
from tests.support.gateway import chat_body, gateway_app, stream_payloads, stream_text
from tests.support.waiting import until

TERM = "Nachtigall über Berlin"
SECRET = "sk-proj-Zq8Xv2Lm4Np6Rt0Yw3Ks9Hd"


def frame(text: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return sse({"id": "up", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


def byte_script(*texts: str, more: int = 0) -> list:
    """The texts as content chunks, written one byte at a time: boundaries fall inside UTF-8
    sequences, JSON and frames; then `more` chunks 20 ms apart, and the end."""
    body = frame("")
    for text in texts:
        body += frame(text)
    script: list = [body[i : i + 1] for i in range(len(body))]
    script += [x for _ in range(more) for x in (0.02, frame(" more"))]
    return [*script, frame(None, "stop"), b"data: [DONE]\n\n"]


def policies_file(tmp_path: Path, **strict) -> tuple[Path, dict, dict]:
    doc = {
        "safety": {
            "strict": {
                "window_chars": 16,
                "block_terms": [TERM, r"/\bcodename-\d+\b/"],
                "redact": ["email", "card", "secret"],
                **strict,
            }
        },
        "tenants": {"acme": {"safety": "strict"}, "open": {}},
    }
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps(doc), encoding="utf-8")
    strict_key, _ = create_key(path, "acme")
    open_key, _ = create_key(path, "open")
    return path, bearer(strict_key), bearer(open_key)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def start(aiohttp_client, tmp_path, upstream, **strict):
    path, strict_auth, open_auth = policies_file(tmp_path, **strict)
    _, url = upstream
    app = gateway_app(upstream=[f"m={url}"], tenants=str(path), api_key=[], disconnect_grace=0)
    return await aiohttp_client(app), strict_auth, open_auth


async def post(client, auth, **body):
    return await client.post("/v1/chat/completions", json=chat_body("m", **body), headers=auth)


def metric(client, name: str, **labels) -> float:
    value = client.app[METRICS].registry.get_sample_value(name, labels)
    return value or 0.0


async def test_a_blocked_term_split_across_chunks_and_code_points_never_reaches_the_client(
    aiohttp_client, tmp_path, upstream
):
    state, _ = upstream
    client, strict, open_ = await start(aiohttp_client, tmp_path, upstream)
    state.scripts["m"] = byte_script(
        "Der Bericht: Nacht", "igall ü", "ber Ber", "lin. Ende.", more=500
    )
    resp = await post(client, strict, stream=True)
    raw = await resp.read()
    payloads = stream_payloads(raw)
    assert b"Nachtigall" not in raw and "über".encode() not in raw
    assert stream_text(payloads) == "Der Bericht: "
    assert payloads[-2]["choices"][0]["finish_reason"] == "content_filter"
    assert payloads[-1] == "[DONE]"
    await until(lambda: state.records[-1].hung_up_at is not None, "the upstream to be stopped")
    assert metric(client, "sluice_safety_actions_total", action="block") == 1
    assert metric(client, "sluice_cancellations_total", source="safety", outcome="unconfirmed")
    assert not state.records[-1].finished
    run_id = payloads[0]["id"]
    stored = await (await client.get(f"/v1/chat/completions/{run_id}", headers=strict)).json()
    assert stored["status"] == "completed"
    assert stored["choices"][0]["finish_reason"] == "content_filter"
    assert stored["choices"][0]["message"]["content"] == "Der Bericht: "
    record = await client.app[RUNS].store.get(run_id)
    assert record.meta["safety"]["policy"] == "strict"
    assert len(record.meta["safety"]["digest"]) == 64
    # the tenant with no policy gets the text as the model wrote it
    state.scripts["m"] = byte_script(
        "Der Bericht: Nacht", "igall ü", "ber Ber", "lin. Ende.", more=2
    )
    payloads = stream_payloads(await (await post(client, open_, stream=True)).read())
    assert stream_text(payloads).startswith(f"Der Bericht: {TERM}. Ende. more")


async def test_secrets_cards_and_emails_split_across_chunks_are_redacted_everywhere(
    aiohttp_client, tmp_path, upstream
):
    state, _ = upstream
    client, strict, _ = await start(aiohttp_client, tmp_path, upstream)
    pieces = [
        "Key ",
        SECRET[:5],
        SECRET[5:11],
        SECRET[11:],
        ", card 4111 11",
        "11 1111 1111",
        ", not 4111 1111 1111 1112; mail ann@exa",
        "mple.org. Bye.",
    ]
    expected = "Key [REDACTED], card [REDACTED], not 4111 1111 1111 1112; mail [REDACTED]. Bye."
    state.scripts["m"] = byte_script(*pieces)
    resp = await post(client, strict, stream=True)
    raw = await resp.read()
    assert SECRET[5:].encode() not in raw and b"ann@" not in raw
    payloads = stream_payloads(raw)
    assert stream_text(payloads) == expected
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"
    run_id = payloads[0]["id"]
    # a resume and the stored object hold exactly what was released
    resumed = await client.get(
        f"/v1/chat/completions/{run_id}?stream=true&starting_after=0", headers=strict
    )
    assert stream_text(stream_payloads(await resumed.read())) == expected
    stored = await (await client.get(f"/v1/chat/completions/{run_id}", headers=strict)).json()
    assert stored["choices"][0]["message"]["content"] == expected
    # not streamed: the same
    state.scripts["m"] = byte_script(*pieces)
    whole = await (await post(client, strict)).json()
    assert whole["choices"][0]["message"]["content"] == expected
    assert metric(client, "sluice_safety_actions_total", action="redact") == 6
    # every upstream delta released waited in the window, and that wait was measured
    assert metric(client, "sluice_safety_hold_seconds_count") == 2 * len(pieces)


async def test_sentence_mode_releases_whole_sentences(aiohttp_client, tmp_path, upstream):
    state, _ = upstream
    client, strict, _ = await start(
        aiohttp_client, tmp_path, upstream, mode="sentence", window_chars=200
    )
    state.scripts["m"] = [
        frame(""),
        frame("One "),
        frame("two. "),
        frame("Three "),
        0.2,
        frame("four."),
        frame(None, "stop"),
        b"data: [DONE]\n\n",
    ]
    resp = await post(client, strict, stream=True)
    raw = await resp.read()
    texts = [
        c["delta"]["content"]
        for p in stream_payloads(raw)
        if isinstance(p, dict) and p.get("choices")
        for c in p["choices"]
        if c["delta"].get("content")
    ]
    assert texts == ["One two.", " Three four."]


class Moderation:
    """An OpenAI-compatible /v1/moderations endpoint: flags inputs holding `flag`."""

    def __init__(self, flag: str = "", hang: bool = False) -> None:
        self.flag, self.hang, self.inputs = flag, hang, []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/moderations", self.moderate)
        return app

    async def moderate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.inputs.append(body["input"])
        if self.hang:
            await asyncio.Event().wait()
        flagged = bool(self.flag) and self.flag in body["input"]
        return web.json_response({"id": "modr", "results": [{"flagged": flagged}]})


@pytest.mark.parametrize(
    ("hang", "on_error", "reason"),
    [
        (False, "block", "content_filter"),  # flagged
        (True, "block", "content_filter"),  # timed out: fail closed
        (True, "allow", "stop"),  # timed out: fail open
    ],
)
async def test_the_remote_checker_flags_and_its_failures_follow_on_error(
    aiohttp_client, aiohttp_server, tmp_path, upstream, hang, on_error, reason
):
    moderation = Moderation(flag="violence", hang=hang)
    server = await aiohttp_server(moderation.app())
    state, _ = upstream
    client, strict, _ = await start(
        aiohttp_client,
        tmp_path,
        upstream,
        moderation_url=f"http://127.0.0.1:{server.port}/v1/moderations",
        moderation_timeout=0.3,
        on_error=on_error,
    )
    state.scripts["m"] = byte_script("a calm start, then some violence", " and the rest.")
    payloads = stream_payloads(await (await post(client, strict, stream=True)).read())
    assert payloads[-2]["choices"][0]["finish_reason"] == reason
    assert moderation.inputs  # it was asked
    if reason == "content_filter":
        assert "violence" not in stream_text(payloads)
    else:
        assert stream_text(payloads) == "a calm start, then some violence and the rest."
    errors = metric(client, "sluice_safety_actions_total", action="checker_error")
    assert errors == (len(moderation.inputs) if hang else 0)  # each failed call counts


async def test_a_disconnect_is_noticed_while_text_is_held(aiohttp_client, tmp_path, upstream):
    state, _ = upstream
    client, strict, _ = await start(
        aiohttp_client, tmp_path, upstream, mode="sentence", window_chars=10_000
    )
    state.scripts["m"] = [frame(""), *[x for _ in range(500) for x in (frame("word "), 0.02)]]
    resp = await post(client, strict, stream=True)
    payloads_seen = await resp.content.readuntil(b"\n\n")  # the role chunk: text is all held
    assert b"assistant" in payloads_seen
    resp.close()
    await until(lambda: state.records[-1].hung_up_at is not None, "the upstream to be stopped")
    assert metric(client, "sluice_cancellations_total", source="disconnect", outcome="unconfirmed")
    assert not state.records[-1].finished


async def test_the_run_end_line_names_the_policy(aiohttp_client, tmp_path, upstream):
    state, _ = upstream
    client, strict, _ = await start(aiohttp_client, tmp_path, upstream)
    state.scripts["m"] = byte_script("plain text.")
    with capture_logs() as logs:
        resp = await post(client, strict)
        assert resp.status == 200
        runs = client.app[RUNS]
        await until(lambda: not runs.drivers, "the run to settle")
    ends = [x for x in logs if x["event"] == "run end"]
    policy = client.app[AUTH].config.tenants["acme"].safety
    assert [x["safety"] for x in ends] == [policy.label]
