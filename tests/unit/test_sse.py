"""The SSE writer's bytes, read back with the `openai` package's own SSE decoder."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from openai._streaming import SSEDecoder

from gateway.http.sse import SSEWriter


def writer_app(script) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        writer = await SSEWriter.open(request, ping_interval=0.05)
        await script(writer)
        await writer.close()
        return writer.response

    app = web.Application()
    app.router.add_get("/", handler)
    return app


async def read_all(client) -> tuple[bytes, dict]:
    resp = await client.get("/")
    raw = await resp.read()
    return raw, dict(resp.headers)


def decode(raw: bytes):
    return list(SSEDecoder().iter_bytes(iter([raw[i : i + 7] for i in range(0, len(raw), 7)])))


async def test_frames_decode_with_ids_and_done(aiohttp_client):
    async def script(writer: SSEWriter) -> None:
        first = [
            (1, orjson.dumps({"n": 1}), None, 0),
            (2, orjson.dumps({"n": "你好"}), None, 0),
        ]
        await writer.send(first)
        await writer.send([(3, orjson.dumps({"n": 3}), None, 0)])

    raw, headers = await read_all(await aiohttp_client(writer_app(script)))
    assert raw == (
        b"retry: 1000\n"  # EventSource's reconnection delay, no event of its own
        b'id: 1\ndata: {"n":1}\n\n'
        b'id: 2\ndata: {"n":"\xe4\xbd\xa0\xe5\xa5\xbd"}\n\n'
        b'id: 3\ndata: {"n":3}\n\n'
        b"data: [DONE]\n\n"
    )
    events = decode(raw)
    # `[DONE]` carries no id of its own; the SSE spec keeps the last one
    assert [e.id for e in events] == ["1", "2", "3", "3"]
    assert [e.data for e in events] == ['{"n":1}', '{"n":"你好"}', '{"n":3}', "[DONE]"]
    assert events[0].retry == 1000
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache"
    assert headers["X-Accel-Buffering"] == "no"


async def test_error_frame_then_done(aiohttp_client):
    async def script(writer: SSEWriter) -> None:
        await writer.send([(1, b'{"a":1}', None, 0)])
        await writer.send_error(
            {"message": "boom", "type": "server_error", "param": None, "code": "upstream_error"}
        )

    raw, _ = await read_all(await aiohttp_client(writer_app(script)))
    events = decode(raw)
    assert events[-1].data == "[DONE]"
    assert events[1].json() == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    }
    assert events[1].id == "1"  # not an event of the run: no id, the last one stands


async def test_idle_stream_gets_ping_comments(aiohttp_client):
    async def script(writer: SSEWriter) -> None:
        await writer.send([(1, b"{}", None, 0)])
        await asyncio.sleep(0.18)  # NOTE: the scenario: an idle stretch long enough for pings
        await writer.send([(1, b"{}", None, 0)])

    raw, _ = await read_all(await aiohttp_client(writer_app(script)))
    assert raw.count(b": ping\n") >= 2
    # pings are comment lines: the decoder sees only the two events and [DONE], with no empty
    # event that the SDK would fail to parse
    assert [e.data for e in decode(raw)] == ["{}", "{}", "[DONE]"]
    # and never inside a frame
    assert all(
        frame.startswith((b"retry: ", b"id: ", b": ping\n", b"data: [DONE]"))
        for frame in raw.split(b"\n\n")
        if frame
    )
