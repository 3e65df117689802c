"""A bare aiohttp byte pass-through: the floor for any relay written on aiohttp, on this machine.

`gateway_overhead.py` runs it beside the gateway so the gateway's numbers can be read against what
copying bytes alone costs on the same machine in the same run. It forwards the request body to the
upstream and writes each upstream read straight back: no parsing, no re-framing, no accounting.

    python bench/passthrough.py --port 8100 --upstream http://127.0.0.1:9001/v1
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def client_session(app: web.Application) -> AsyncIterator[None]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        app[SESSION] = session
        yield


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        response = web.StreamResponse(
            status=upstream.status, headers={"Content-Type": upstream.content_type}
        )
        await response.prepare(request)
        async for data in upstream.content.iter_any():
            await response.write(data)
        await response.write_eof()
        return response


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, ending in /v1")
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(client_session)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/healthz", healthz)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
