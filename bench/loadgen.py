"""The load generator process of `gateway_overhead.py`: cheap per chunk, so it measures the target.

It reads one cell per line on stdin (JSON: url, headers, body, concurrency, requests, min_seconds,
chunks), runs it, and answers one JSON line on stdout; it exits at the end of its input. Streams
are read raw with `iter_any`, and content frames are counted by a byte pattern instead of being
decoded, so a chunk costs the generator little more than its share of a socket read. TTFT runs
from just before the request is sent to the read that brings the first content frame.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

import aiohttp

# Both the upstream and the gateway put a text delta as `"delta":{"content":"…"}`; the role chunk
# (`{"role":…,"content":""}`) and the finish chunk (`{}`) do not match.
CONTENT = b'"delta":{"content":"'
KEEP = len(CONTENT) - 1  # a tail this long cannot hold a whole match, so none is counted twice


async def one_stream(
    session: aiohttp.ClientSession, url: str, headers: dict, body: bytes
) -> tuple[float | None, int, int]:
    """(seconds to the first content frame, content frames, HTTP status) of one request."""
    first = None
    frames = 0
    tail = b""
    sent = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as resp:
        async for data in resp.content.iter_any():
            buf = tail + data if tail else data
            found = buf.count(CONTENT)
            if found:
                if first is None:
                    first = time.perf_counter() - sent
                frames += found
            tail = buf[-KEEP:]
        return first, frames, resp.status


async def run_cell(session: aiohttp.ClientSession, cell: dict) -> dict:
    """At least `requests` streams and `min_seconds` of streaming, `concurrency` streams at a
    time, each started as soon as a slot frees."""
    body = json.dumps(cell["body"]).encode()
    url, headers = cell["url"], cell["headers"]
    left = cell["requests"]
    ttfts: list[float] = []
    frames = 0
    errors: list[str] = []

    async def client() -> None:
        nonlocal left, frames
        while left > 0 or time.perf_counter() < until:
            left -= 1
            sent_headers = headers
            if cell.get("idempotency"):  # a fresh key per request: every one is a first attempt
                sent_headers = {**headers, "Idempotency-Key": uuid.uuid4().hex}
            try:
                first, got, status = await one_stream(session, url, sent_headers, body)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                errors.append(type(exc).__name__)
                continue
            frames += got
            # a safety window merges what it held: then any number of frames is whole
            wrong = got != cell["chunks"] if cell.get("exact_chunks", True) else got < 1
            if status != 200 or wrong or first is None:
                errors.append(f"status {status}, {got} content frames")
            else:
                ttfts.append(first)

    cpu = time.process_time()
    start = time.perf_counter()
    until = start + cell["min_seconds"]
    await asyncio.gather(*(client() for _ in range(cell["concurrency"])))
    wall = time.perf_counter() - start
    return {
        "ttft_s": ttfts,
        "frames": frames,
        "wall_s": wall,
        "errors": errors[:5],
        "error_count": len(errors),
        "loadgen_cpu_s": time.process_time() - cpu,
    }


async def main() -> None:
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            result = await run_cell(session, json.loads(line))
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
