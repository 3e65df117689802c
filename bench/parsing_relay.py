"""A minimal parsing relay on uvloop: the floor for any relay that reads what it streams.

`gateway_overhead.py` runs it beside the gateway. Where `passthrough.py` copies bytes, this one
does the least a gateway must: it splits the upstream's SSE stream into events, parses each
`data:` chunk as JSON and writes it back re-framed (`id: n`, `data: <JSON>`), then `[DONE]`. No
auth, no run log, no accounting: what is left between it and the gateway is the gateway's own.

    python bench/parsing_relay.py --port 8100 --upstream http://127.0.0.1:9001/v1

`--loop asyncio` runs the same relay on asyncio's own loop, the gateway's: what of the gap
between the floor and the gateway is the loop's.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import uvloop
from aiohttp import web

from gateway.eager_tasks import start_request_writes_eagerly

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)
DONE = b"[DONE]"


async def client_session(app: web.Application) -> AsyncIterator[None]:
    # NOTE: as `sluice serve` does: aiohttp's task that writes the upstream request's body
    # starts eagerly (on Python 3.11 it would wait out a turn), so the floor has no hand-off
    # on a first token's way that the gateway does not have either
    start_request_writes_eagerly(asyncio.get_running_loop())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        app[SESSION] = session
        yield


def reframe(event: bytes, seq: int) -> bytes:
    """One upstream SSE event, its JSON parsed and written again; b"" for anything else."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == DONE:
                return b"data: [DONE]\n\n"
            return b"id: %d\ndata: %s\n\n" % (seq, orjson.dumps(orjson.loads(data)))
    return b""


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        response = web.StreamResponse(
            status=upstream.status, headers={"Content-Type": upstream.content_type}
        )
        await response.prepare(request)
        pending, seq = b"", 0
        async for data in upstream.content.iter_any():
            *events, pending = (pending + data).split(b"\n\n")
            out = []
            for event in events:
                seq += 1
                out.append(reframe(event, seq))
            await response.write(b"".join(out))
        await response.write_eof()
        return response


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, ending in /v1")
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the event loop"
    )
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(client_session)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/healthz", healthz)
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop() if args.loop == "uvloop" else asyncio.new_event_loop(),
    )


if __name__ == "__main__":
    main()
