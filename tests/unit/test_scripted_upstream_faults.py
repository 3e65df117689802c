"""The scripted upstream's faults, outages, counts and continuation: each fault kind does to a
client what testkit/upstream_faults.py says, the seeded choice replays, and a continued stream
reads as the rest of an uninterrupted one."""

from __future__ import annotations

import time
from collections import Counter
from itertools import pairwise

import aiohttp
import orjson
import pytest

from testkit.scripted_upstream import UpstreamState, make_app, resume_point, token_text
from testkit.upstream_faults import FAULT_KINDS, Fault, Faults

TOKENS = 12
WHOLE = "".join(token_text(i) for i in range(TOKENS))


def body(**extra) -> dict:
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": TOKENS,
        "stream": True,
    } | extra


def continued(text: str, **extra) -> dict:
    """A request to continue `text` as an open assistant message (vLLM's form)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]
    return body(messages=messages, continue_final_message=True, add_generation_prompt=False) | extra


async def serve(aiohttp_client, **state) -> tuple[aiohttp.ClientSession, UpstreamState]:
    upstream = UpstreamState(**state)
    return await aiohttp_client(make_app(upstream)), upstream


async def read_stream(resp: aiohttp.ClientResponse) -> dict:
    """The frames of a stream as they came: (arrival, payload bytes) each, and how it ended
    (`eof`, or the connection error's class name)."""
    frames: list[tuple[float, bytes]] = []
    ended = "eof"
    buffer = b""
    try:
        async for data in resp.content.iter_any():
            buffer += data
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                frames.append((time.monotonic(), frame.removeprefix(b"data: ")))
    except aiohttp.ClientPayloadError as exc:
        ended = type(exc).__name__
    return {"frames": frames, "ended": ended}


def content(frames: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    """(arrival, text) of each content chunk among well-formed frames."""
    out = []
    for at, payload in frames:
        if payload == b"[DONE]":
            continue
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        for choice in chunk["choices"]:
            if text := choice["delta"].get("content"):
                out.append((at, text))
    return out


def faults(kind: str, **extra) -> Faults:
    return Faults(rate=1.0, kinds=(kind,), seed=3, **extra)


# -- the draw -----------------------------------------------------------------------------------


def test_the_seeded_draw_replays_and_spreads_over_every_kind():
    first, again = Faults(rate=0.1, seed=11), Faults(rate=0.1, seed=11)
    drawn = [first.draw(TOKENS) for _ in range(4000)]
    assert drawn == [again.draw(TOKENS) for _ in range(4000)]
    hits = [f for f in drawn if f is not None]
    assert 300 < len(hits) < 500  # 10% of 4,000
    assert set(Counter(f.kind for f in hits)) == set(FAULT_KINDS)
    assert drawn != [Faults(rate=0.1, seed=12).draw(TOKENS) for _ in range(4000)]


def test_mid_stream_faults_come_after_a_few_chunks_and_short_of_the_end():
    drawn = [Faults(rate=1.0, seed=s).draw(TOKENS) for s in range(400)]
    for fault in drawn:
        if fault.kind in ("cut", "stall_after", "malformed", "no_done"):
            assert 1 <= fault.after <= 4
        else:
            assert fault.after == 0
    assert Faults(rate=1.0, kinds=("cut",), seed=1).draw(2) == Fault("cut", 1)


def test_kinds_restrict_the_draw_and_unknown_ones_are_refused():
    only = Faults(rate=1.0, kinds=("500", "no_done"), seed=5)
    assert {only.draw(TOKENS).kind for _ in range(100)} == {"500", "no_done"}
    assert Faults().draw(TOKENS) is None  # rate 0: none
    with pytest.raises(ValueError):
        Faults(kinds=("explode",))


# -- each kind, on the wire ---------------------------------------------------------------------


async def test_refuse_closes_the_connection_without_an_answer(aiohttp_client):
    client, state = await serve(aiohttp_client, faults=faults("refuse"))
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post("/v1/chat/completions", json=body())
    assert state.stats.faults == {"refuse": 1} and state.stats.tokens == 0


@pytest.mark.parametrize(("kind", "retry_after"), [("500", None), ("429", "1")])
async def test_status_faults_answer_an_error_body(aiohttp_client, kind, retry_after):
    client, state = await serve(aiohttp_client, faults=faults(kind))
    resp = await client.post("/v1/chat/completions", json=body())
    assert resp.status == int(kind)
    assert resp.headers.get("retry-after") == retry_after
    assert (await resp.json())["error"]["message"] == f"scripted fault {kind}"
    assert state.stats.tokens == 0


async def test_cut_sends_a_few_tokens_then_breaks_the_connection(aiohttp_client):
    client, state = await serve(aiohttp_client, faults=faults("cut", cut_pause_s=0.0))
    after = Faults(rate=1.0, kinds=("cut",), seed=3).draw(TOKENS).after
    seen = await read_stream(await client.post("/v1/chat/completions", json=body()))
    assert seen["ended"] == "ClientPayloadError"  # the chunked body never ended
    assert [text for _, text in content(seen["frames"])] == [token_text(i) for i in range(after)]
    assert b"[DONE]" not in [payload for _, payload in seen["frames"]]
    assert state.stats.tokens == after
    assert not state.records[0].finished and state.records[0].hung_up_at is None


def gaps(arrivals: list[float]) -> list[float]:
    return [later - earlier for earlier, later in pairwise(arrivals)]


# NOTE: the client reads each chunk some time after the upstream wrote it, so the gap it sees
# across a stall can be a little short of the stall (the chunk before it read late): a stall is
# the one gap of most of its length, the others being a few milliseconds
STALL_S = 0.3
SEEN_STALL_S = 0.8 * STALL_S


async def test_stall_before_holds_the_first_token_then_streams_it_all(aiohttp_client):
    client, _ = await serve(aiohttp_client, faults=faults("stall_before", stall_s=STALL_S))
    seen = await read_stream(await client.post("/v1/chat/completions", json=body()))
    chunks = content(seen["frames"])
    waits = gaps([seen["frames"][0][0]] + [at for at, _ in chunks])  # from the role chunk on
    assert waits[0] >= SEEN_STALL_S and max(waits[1:]) < SEEN_STALL_S
    assert "".join(text for _, text in chunks) == WHOLE
    assert seen["frames"][-1][1] == b"[DONE]" and seen["ended"] == "eof"


async def test_stall_after_stops_after_a_few_tokens_with_the_connection_open(aiohttp_client):
    client, state = await serve(aiohttp_client, faults=faults("stall_after", stall_s=STALL_S))
    after = Faults(rate=1.0, kinds=("stall_after",), seed=3).draw(TOKENS).after
    seen = await read_stream(await client.post("/v1/chat/completions", json=body()))
    chunks = content(seen["frames"])
    waits = gaps([at for at, _ in chunks])
    stall = waits.pop(after - 1)  # between the `after` chunks before it and the rest
    assert stall >= SEEN_STALL_S and max(waits) < SEEN_STALL_S
    assert "".join(text for _, text in chunks) == WHOLE
    assert seen["frames"][-1][1] == b"[DONE]" and state.stats.tokens == TOKENS


async def test_malformed_sends_a_chunk_that_is_not_json_and_ends(aiohttp_client):
    client, state = await serve(aiohttp_client, faults=faults("malformed"))
    after = Faults(rate=1.0, kinds=("malformed",), seed=3).draw(TOKENS).after
    seen = await read_stream(await client.post("/v1/chat/completions", json=body()))
    payloads = [payload for _, payload in seen["frames"]]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(payloads[-1])
    assert len(content(seen["frames"])) == after == state.stats.tokens
    assert seen["ended"] == "eof"


async def test_no_done_ends_the_body_after_a_few_tokens(aiohttp_client):
    client, state = await serve(aiohttp_client, faults=faults("no_done"))
    after = Faults(rate=1.0, kinds=("no_done",), seed=3).draw(TOKENS).after
    seen = await read_stream(await client.post("/v1/chat/completions", json=body()))
    assert seen["ended"] == "eof"
    chunks = [orjson.loads(payload) for _, payload in seen["frames"]]  # every frame is JSON
    assert len(chunks) == 1 + after  # the role chunk and the tokens: no finish, usage, [DONE]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert state.stats.tokens == after


async def test_faults_leave_scripted_models_and_non_streaming_requests_alone(aiohttp_client):
    client, state = await serve(aiohttp_client, faults=faults("500"))
    resp = await client.post("/v1/chat/completions", json=body(stream=False))
    assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == WHOLE
    state.scripts["own"] = [b"data: [DONE]\n\n"]
    resp = await client.post("/v1/chat/completions", json=body(model="own"))
    assert resp.status == 200 and await resp.read() == b"data: [DONE]\n\n"
    assert state.stats.faults == {}


# -- counts and outages -------------------------------------------------------------------------


async def test_stats_count_requests_tokens_and_faults(aiohttp_client):
    client, _ = await serve(aiohttp_client, faults=faults("429"))
    await client.post("/v1/chat/completions", json=body())
    await client.post("/v1/chat/completions", json=body(stream=False, max_tokens=3))
    await read_stream(await client.post("/v1/chat/completions", json=continued("tok0 ")))
    stats = await (await client.get("/_chaos/stats")).json()
    assert stats == {
        "requests": 3,
        "continued": 1,
        "tokens": 3,  # the non-streaming answer's; the 429s generated none
        "dropped": 0,
        "faults": {"429": 2},
    }


async def test_an_outage_drops_every_request_until_it_ends(aiohttp_client):
    client, state = await serve(aiohttp_client)
    resp = await client.post("/_chaos/down", params={"seconds": "30"})
    assert await resp.json() == {"down_for_s": 30.0}
    for path in ("/v1/chat/completions", "/v1/models"):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.request("POST" if "chat" in path else "GET", path, json=body())
    assert (await (await client.get("/_chaos/stats")).json())["dropped"] == 2
    state.outage.until = 0.0  # the outage over
    assert (await client.get("/v1/models")).status == 200
    refused = await client.post("/_chaos/down", params={"seconds": "1", "how": "refuse"})
    assert refused.status == 400  # a closed listener needs the standalone server


async def test_an_outage_cuts_the_streams_in_flight(aiohttp_client):
    client, state = await serve(aiohttp_client, delay_ms=20)
    resp = await client.post("/v1/chat/completions", json=body())
    first = await resp.content.readuntil(b"tok0")  # streaming
    await client.post("/_chaos/down", params={"seconds": "30"})
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()  # cut at its next write
    assert b"tok0" in first and 1 <= state.stats.tokens < TOKENS
    assert not state.records[0].finished


# -- continuation -------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 5, TOKENS - 1])
async def test_a_continued_stream_is_the_rest_of_the_uninterrupted_one(aiohttp_client, cut):
    client, _ = await serve(aiohttp_client)
    sent = "".join(token_text(i) for i in range(cut))
    resp = await client.post("/v1/chat/completions", json=continued(sent, max_tokens=TOKENS - cut))
    seen = await read_stream(resp)
    assert sent + "".join(text for _, text in content(seen["frames"])) == WHOLE
    usage = orjson.loads(seen["frames"][-2][1])["usage"]
    assert usage == {"prompt_tokens": 7 + cut, "completion_tokens": TOKENS - cut,
                     "total_tokens": 7 + TOKENS}  # fmt: skip


async def test_continuation_inside_a_token_and_without_max_tokens(aiohttp_client):
    client, _ = await serve(aiohttp_client)
    request = continued("tok0 tok1 to", stream=False)
    del request["max_tokens"]  # the default length, 16 tokens in all
    answer = await (await client.post("/v1/chat/completions", json=request)).json()
    rest = "k2 " + "".join(token_text(i) for i in range(3, 16))
    assert answer["choices"][0]["message"]["content"] == rest
    assert answer["usage"]["completion_tokens"] == 14
    assert resume_point("tok0 tok1 ") == (2, "") and resume_point("tok0 tok1 to") == (2, "k2 ")
    assert resume_point("hello") == (0, "")


async def test_continue_final_message_needs_its_form(aiohttp_client):
    client, _ = await serve(aiohttp_client)
    for request in (
        continued("tok0 ") | {"add_generation_prompt": True},
        body(continue_final_message=True, add_generation_prompt=False),  # last message: user
    ):
        resp = await client.post("/v1/chat/completions", json=request)
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "continue_final_message"
