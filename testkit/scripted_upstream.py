"""A scripted OpenAI-compatible server: the upstream tests and benchmarks drive the gateway with.

Default behaviour: `POST /v1/chat/completions` streams `max_tokens` (default 16) chunks of one
"token" each, `delay_ms` apart (from `metadata.delay_ms` or the server default), then a usage
chunk and `[DONE]`; non-streaming requests get one `chat.completion`. Tests can install a raw
script for a model: a list of byte strings to write and float delays, so chunk boundaries can fall
inside words and UTF-8 code points, or a function of the request body that returns one (to answer
a conversation's turns differently). `tool_call_script` streams tool calls with their arguments in
fragments, as an OpenAI-compatible server does. Every request is recorded, with whether the client
hung up before the end. `first_token_ms` sets a first token's delay of its own (a server's TTFT),
and `concurrency` serves that many streams at once, the rest waiting in arrival order as a
server with a fixed batch makes them wait.

Run standalone: `python -m testkit.scripted_upstream --port 9001 --delay-ms 20`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

Raw = list[bytes | float]
Script = Raw | Callable[[dict[str, Any]], Raw]  # a function of the request body


@dataclass
class Record:
    body: dict[str, Any]
    headers: dict[str, str]
    finished: bool = False
    hung_up_at: float | None = None


@dataclass
class UpstreamState:
    delay_ms: float = 0.0
    scripts: dict[str, Script] = field(default_factory=dict)
    status_for: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    max_tokens: int | None = None  # the server's own limit: longer requests end at it
    first_token_ms: float | None = None  # before the first token (None: delay_ms, as the rest)
    # streams served at once, as a server with a fixed batch: the rest wait their turn in
    # arrival order, headers sent, no token yet (None: no limit)
    concurrency: int | None = None
    slots: asyncio.Semaphore | None = None


STATE = web.AppKey("state", UpstreamState)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(
    cid: str,
    model: str,
    delta: dict,
    finish: str | None = None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        ],
    }


def _usage_chunk(cid: str, model: str, prompt: int, completion: int) -> bytes:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return sse(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [],
            "usage": usage,
        }
    )


def _logprobs(token: str, top: int) -> dict:
    """OpenAI's logprobs of one token, with `top` alternatives."""

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    alternatives = [entry(f"{token}{k}", -1.0 - k) for k in range(top)]
    return {"content": [entry(token, -0.5) | {"top_logprobs": alternatives}]}


def token_script(
    cid: str,
    model: str,
    tokens: int,
    delay_s: float,
    n: int = 1,
    top_logprobs: int | None = None,
    first_s: float | None = None,
) -> Raw:
    """Role chunks, `tokens` one-token chunks per choice `delay_s` apart (the first `first_s`
    after the role chunks, when given), finishes, usage, `[DONE]`; with `top_logprobs`, each
    token chunk carries its logprobs.

    Frames with no delay between them go out in one write, as a server that has several tokens
    ready sends them; at zero delay the whole response is one write.
    """
    out: Raw = [
        sse(_chunk(cid, model, {"role": "assistant", "content": ""}, index=i)) for i in range(n)
    ]
    for i in range(tokens):
        delay = first_s if i == 0 and first_s is not None else delay_s
        if delay:
            out.append(delay)
        for index in range(n):
            text = f"tok{i} "
            lp = None if top_logprobs is None else _logprobs(text, top_logprobs)
            out.append(sse(_chunk(cid, model, {"content": text}, index=index, logprobs=lp)))
    out += [sse(_chunk(cid, model, {}, "length", index=i)) for i in range(n)]
    out += [_usage_chunk(cid, model, 7, tokens * n), b"data: [DONE]\n\n"]
    return coalesce(out)


def _split(text: str, pieces: int) -> list[str]:
    """`text` in `pieces` consecutive parts (some empty when it is shorter)."""
    size = -(-len(text) // pieces) if text else 0
    return [text[k * size : (k + 1) * size] for k in range(pieces)]


def tool_call_script(
    cid: str,
    model: str,
    calls: list[tuple[str, str, str]],
    pieces: int = 20,
    finish: str | None = "tool_calls",
    index: int = 0,
) -> Raw:
    """Role, then each call of `calls` (id, name, arguments) as OpenAI streams it: one chunk
    with its index, id and name, then its arguments in `pieces` chunks, each its own write;
    then the finish (none when `finish` is None), usage and `[DONE]`."""
    out: Raw = [sse(_chunk(cid, model, {"role": "assistant", "content": None}, index=index))]
    for k, (call_id, name, arguments) in enumerate(calls):
        head = {"index": k, "id": call_id, "type": "function"}
        head["function"] = {"name": name, "arguments": ""}
        out.append(sse(_chunk(cid, model, {"tool_calls": [head]}, index=index)))
        for piece in _split(arguments, pieces):
            fragment = {"index": k, "function": {"arguments": piece}}
            out += [0.0, sse(_chunk(cid, model, {"tool_calls": [fragment]}, index=index))]
    if finish is not None:
        out.append(sse(_chunk(cid, model, {}, finish, index=index)))
    out += [_usage_chunk(cid, model, 7, 9), b"data: [DONE]\n\n"]
    return out


def coalesce(script: Raw) -> Raw:
    """Join consecutive byte steps into one write."""
    merged: Raw = []
    pending: list[bytes] = []
    for step in script:
        if isinstance(step, bytes):
            pending.append(step)
            continue
        if pending:
            merged.append(b"".join(pending))
            pending = []
        merged.append(step)
    if pending:
        merged.append(b"".join(pending))
    return merged


async def chat(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = orjson.loads(await request.read())
    record = Record(body, dict(request.headers))
    state.records.append(record)
    model = body.get("model", "scripted")
    if model in state.status_for:
        status, payload = state.status_for[model]
        return web.json_response(payload, status=status)
    tokens = int(body.get("max_tokens") or 16)
    if state.max_tokens is not None:
        tokens = min(tokens, state.max_tokens)
    delay_ms = float((body.get("metadata") or {}).get("delay_ms", state.delay_ms))
    cid = "chatcmpl-upstream"
    top = body.get("top_logprobs") if body.get("logprobs") else None
    script = state.scripts.get(model)
    if callable(script):
        script = script(body)
    first = None if state.first_token_ms is None else state.first_token_ms / 1000
    script = script or token_script(
        cid, model, tokens, delay_ms / 1000, int(body.get("n") or 1), top, first
    )
    if not body.get("stream"):
        text = "".join(f"tok{i} " for i in range(tokens))
        record.finished = True
        return web.json_response(
            {
                "id": cid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": 7,
                    "completion_tokens": tokens,
                    "total_tokens": 7 + tokens,
                },
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        async with contextlib.AsyncExitStack() as slot:
            if state.concurrency is not None:
                state.slots = state.slots or asyncio.Semaphore(state.concurrency)
                await slot.enter_async_context(state.slots)
            await _play(resp, script)
        record.finished = True
    except (ConnectionError, asyncio.CancelledError):
        record.hung_up_at = time.monotonic()
        raise
    return resp


async def _play(resp: web.StreamResponse, script: Raw) -> None:
    for step in script:
        if isinstance(step, float):
            await asyncio.sleep(step)
        else:
            await resp.write(step)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})


def make_app(state: UpstreamState | None = None) -> web.Application:
    app = web.Application()
    app[STATE] = state or UpstreamState()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, help="end every completion at this many tokens")
    parser.add_argument("--first-token-ms", type=float, help="delay before the first token")
    parser.add_argument("--concurrency", type=int, help="streams served at once; others wait")
    args = parser.parse_args()
    state = UpstreamState(
        delay_ms=args.delay_ms,
        max_tokens=args.max_tokens,
        first_token_ms=args.first_token_ms,
        concurrency=args.concurrency,
    )
    web.run_app(
        make_app(state),
        host=args.host,
        port=args.port,
        print=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
