"""A scripted OpenAI-compatible server: the upstream tests and benchmarks drive the gateway with.

Default behaviour: `POST /v1/chat/completions` streams `max_tokens` (default 16) chunks of one
"token" each, `delay_ms` apart (from `metadata.delay_ms` or the server default), then a usage
chunk and `[DONE]`; non-streaming requests get one `chat.completion`. `POST /v1/completions`
streams the same tokens as legacy `text_completion` chunks (a raw prompt). Tests can install a raw
script for a model: a list of byte strings to write and float delays, so chunk boundaries can fall
inside words and UTF-8 code points, or a function of the request body that returns one (to answer
a conversation's turns differently). `tool_call_script` streams tool calls with their arguments in
fragments, as an OpenAI-compatible server does. Every request is recorded, with whether the client
hung up before the end. `first_token_ms` sets a first token's delay of its own (a server's TTFT),
and `concurrency` serves that many streams at once, the rest waiting in arrival order as a
server with a fixed batch makes them wait.

The default text is a deterministic sequence, `tok0 tok1 …`, one token a chunk. A request whose
last message is an open assistant message (`continue_final_message: true` with
`add_generation_prompt: false`, vLLM's form) is continued from where that text ends, so a run
cut after k tokens and continued here reads as one uninterrupted run; its usage counts the
carried tokens in its prompt, as a real server's does.

Chaos (testkit/upstream_faults.py): `faults` injects a fault of a random kind (a refused
connection, a 500, a 429, a cut, a stall, a malformed chunk, no `[DONE]`) into a share of the
default streams, `POST /_chaos/down?seconds=S` drops every request for a while, and
`GET /_chaos/stats` counts the requests it got and the tokens it generated.

`POST /v1/embeddings` answers OpenAI's shape with `EMBEDDING_SIZE` floats per input, derived
from the text's hash (the same text, the same unit vector); `dimensions` truncates them, and
one above the size is a 400 naming it; each input's words count as its tokens.

Run standalone: `python -m testkit.scripted_upstream --port 9001 --delay-ms 20`
(`--faults 0.1 --seed 1` for faults; `--help` for the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from testkit.upstream_faults import (
    ANSWERED,
    FAULT_KINDS,
    OUTAGE,
    STATS,
    ChaosStats,
    Close,
    Faults,
    Outage,
    SiteListener,
    answer,
    down,
    faulted,
    outage_middleware,
    stats,
)

Raw = list[bytes | float]
Script = Raw | Callable[[dict[str, Any]], Raw]  # a function of the request body
DEFAULT_TOKENS = 16  # a request without max_tokens ends here, counting a continued one's carry
PROMPT_TOKENS = 7  # every prompt's usage, plus the tokens an open assistant message carries


@dataclass(slots=True, frozen=True)
class Tokens:
    """A write of the default stream that carries `count` generated tokens (counted once
    written)."""

    data: bytes
    count: int


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
    faults: Faults = field(default_factory=Faults)  # none unless its rate is set
    outage: Outage = field(default_factory=Outage)
    stats: ChaosStats = field(default_factory=ChaosStats)


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


def token_text(i: int) -> str:
    """The default stream's token `i`."""
    return f"tok{i} "


def resume_point(text: str) -> tuple[int, str]:
    """Where the default sequence goes on after `text`: the index of the next token, and what
    is left of it when `text` ends inside it ("" when it does not). Text that leaves the
    sequence goes on after the whole tokens it starts with."""
    i = pos = 0
    while text.startswith(token_text(i), pos):
        pos += len(token_text(i))
        i += 1
    rest, word = text[pos:], token_text(i)
    return (i, word[len(rest) :]) if rest and word.startswith(rest) else (i, "")


def _continues(body: dict[str, Any]) -> bool:
    """Whether the last message is an open assistant message to continue (vLLM's form)."""
    messages = body.get("messages") or []
    return bool(
        body.get("continue_final_message") and messages and messages[-1].get("role") == "assistant"
    )


def completion_texts(body: dict[str, Any], limit: int | None) -> tuple[list[str], int]:
    """The token texts a request of the default stream gets, and the tokens of the text it
    continues (0 when it continues none): its `max_tokens` (else up to DEFAULT_TOKENS in all)
    from where that text ends, within the server's own `limit`."""
    start, lead = 0, ""
    if _continues(body):
        content = body["messages"][-1].get("content")
        start, lead = resume_point(content if isinstance(content, str) else "")
    tokens = int(body.get("max_tokens") or max(0, DEFAULT_TOKENS - start))
    if limit is not None:
        tokens = min(tokens, limit)
    texts = [token_text(start + i) for i in range(tokens)]
    if lead and texts:
        texts[0] = lead
    return texts, start + bool(lead)


def token_parts(
    cid: str,
    model: str,
    texts: list[str],
    delay_s: float,
    n: int = 1,
    top_logprobs: int | None = None,
    first_s: float | None = None,
    prompt: int = PROMPT_TOKENS,
) -> tuple[list, list[list], list]:
    """The default stream in three parts, which a fault can break apart: the role chunks; each
    token's steps (its delay, then its chunk for every choice, `delay_s` apart and the first
    `first_s` after the role chunks when given, with its logprobs when `top_logprobs` is);
    finishes, usage and `[DONE]`."""
    head = [
        sse(_chunk(cid, model, {"role": "assistant", "content": ""}, index=i)) for i in range(n)
    ]
    steps = []
    for i, text in enumerate(texts):
        delay = first_s if i == 0 and first_s is not None else delay_s
        lp = None if top_logprobs is None else _logprobs(text, top_logprobs)
        chunks = b"".join(
            sse(_chunk(cid, model, {"content": text}, index=index, logprobs=lp))
            for index in range(n)
        )
        steps.append([delay, Tokens(chunks, n)] if delay else [Tokens(chunks, n)])
    tail = [sse(_chunk(cid, model, {}, "length", index=i)) for i in range(n)]
    tail += [_usage_chunk(cid, model, prompt, len(texts) * n), b"data: [DONE]\n\n"]
    return head, steps, tail


def token_script(parts: tuple[list, list[list], list]) -> list:
    """The default stream's parts (`token_parts`) as its writes. Frames with no delay between
    them go out in one write, as a server that has several tokens ready sends them; at zero
    delay the whole response is one write."""
    head, steps, tail = parts
    return coalesce([*head, *(s for step in steps for s in step), *tail])


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


def coalesce(script: list) -> list:
    """Join consecutive byte steps (and `Tokens`, whose counts add up) into one write."""
    merged: list = []
    pending: list[bytes] = []
    count = 0

    def flush() -> None:
        nonlocal count
        if pending:
            data = b"".join(pending)
            merged.append(Tokens(data, count) if count else data)
            pending.clear()
            count = 0

    for step in script:
        if isinstance(step, bytes | Tokens):
            pending.append(step if isinstance(step, bytes) else step.data)
            count += 0 if isinstance(step, bytes) else step.count
            continue
        flush()
        merged.append(step)
    flush()
    return merged


async def _recorded(request: web.Request) -> tuple[Record, web.Response | None]:
    """The request recorded and counted; the answer scripted for its model (`status_for`), if
    any."""
    state = request.app[STATE]
    body = orjson.loads(await request.read())
    record = Record(body, dict(request.headers))
    state.records.append(record)
    state.stats.requests += 1
    scripted = state.status_for.get(body.get("model", "scripted"))
    if scripted is None:
        return record, None
    status, payload = scripted
    return record, web.json_response(payload, status=status)


async def chat(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    record, refusal = await _recorded(request)
    if refusal is not None:
        return refusal
    body = record.body
    model = body.get("model", "scripted")
    if body.get("continue_final_message") and (
        body.get("add_generation_prompt", True) or not _continues(body)
    ):
        return _refused("continue_final_message")
    texts, carried = completion_texts(body, state.max_tokens)
    state.stats.continued += _continues(body)
    prompt = PROMPT_TOKENS + carried
    delay_ms = float((body.get("metadata") or {}).get("delay_ms", state.delay_ms))
    cid = "chatcmpl-upstream"
    top = body.get("top_logprobs") if body.get("logprobs") else None
    script = state.scripts.get(model)
    if callable(script):
        script = script(body)
    if not body.get("stream"):
        record.finished = True
        state.stats.tokens += len(texts)
        return _completion(cid, model, "".join(texts), prompt, len(texts))
    first = None if state.first_token_ms is None else state.first_token_ms / 1000
    n = int(body.get("n") or 1)
    fault = None if script else state.faults.draw(len(texts))
    if fault is not None:
        state.stats.faults[fault.kind] += 1
        if fault.kind in ANSWERED:
            return answer(request, fault)
    if not script:
        parts = token_parts(cid, model, texts, delay_ms / 1000, n, top, first, prompt)
        script = token_script(parts) if fault is None else faulted(*parts, fault, state.faults)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        async with contextlib.AsyncExitStack() as slot:
            if state.concurrency is not None:
                state.slots = state.slots or asyncio.Semaphore(state.concurrency)
                await slot.enter_async_context(state.slots)
            record.finished = await _play(request, resp, script, state)
    except (ConnectionError, asyncio.CancelledError):
        record.hung_up_at = time.monotonic()
        raise
    return resp


def _completion(cid: str, model: str, text: str, prompt: int, tokens: int) -> web.Response:
    """A non-streaming answer."""
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
                "prompt_tokens": prompt,
                "completion_tokens": tokens,
                "total_tokens": prompt + tokens,
            },
        }
    )


def _refused(param: str) -> web.Response:
    """A 400 naming `param`, as vLLM answers `continue_final_message` without an open
    assistant message or with `add_generation_prompt`."""
    error = {
        "message": "continue_final_message needs add_generation_prompt: false and a final "
        "assistant message",
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
    return web.json_response({"error": error}, status=400)


async def _play(
    request: web.Request, resp: web.StreamResponse, script: list, state: UpstreamState
) -> bool:
    """Write `script` out; whether it played to its end. A `Close` step cuts the connection
    instead, and so does an outage begun meanwhile (at the next write: a server that went down
    takes its streams with it). The tokens of each write count once it is written."""
    for step in script:
        if isinstance(step, float):
            await asyncio.sleep(step)
        elif isinstance(step, Close) or state.outage.active:
            if request.transport is not None:
                request.transport.close()
            return False
        elif isinstance(step, Tokens):
            await resp.write(step.data)
            state.stats.tokens += step.count
        else:
            await resp.write(step)
    return True


def _legacy_chunk(
    cid: str, model: str, text: str, index: int, top: int | None, finish: str | None = None
) -> bytes:
    """One `text_completion` chunk, with the legacy logprobs of its token when `top` is set."""
    logprobs = None
    if top is not None and text:
        content = _logprobs(text, top)["content"][0]
        logprobs = {
            "tokens": [text],
            "token_logprobs": [content["logprob"]],
            "top_logprobs": [{t["token"]: t["logprob"] for t in content["top_logprobs"]}],
            "text_offset": [0],
        }
    choice = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
    return sse(
        {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
    )


async def legacy_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: the default token sequence as a legacy `text_completion` stream
    (a raw prompt: nothing is continued), recorded as chat requests are. Streams only, as the
    gateway always asks."""
    state = request.app[STATE]
    record, refusal = await _recorded(request)
    if refusal is not None:
        return refusal
    body = record.body
    model = body.get("model", "scripted")
    texts, _ = completion_texts({"max_tokens": body.get("max_tokens")}, state.max_tokens)
    n, top = int(body.get("n") or 1), body.get("logprobs")
    delay = float(state.delay_ms) / 1000
    cid = "cmpl-upstream"
    script: list = []
    for text in texts:
        chunks = b"".join(_legacy_chunk(cid, model, text, i, top) for i in range(n))
        script += [delay, Tokens(chunks, n)] if delay else [Tokens(chunks, n)]
    script += [_legacy_chunk(cid, model, "", i, None, "length") for i in range(n)]
    usage = _usage_chunk(cid, model, PROMPT_TOKENS, len(texts) * n)
    script += [usage.replace(b"chat.completion.chunk", b"text_completion"), b"data: [DONE]\n\n"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        record.finished = await _play(request, resp, coalesce(script), state)
    except (ConnectionError, asyncio.CancelledError):
        record.hung_up_at = time.monotonic()
        raise
    return resp


EMBEDDING_SIZE = 8


def embedding_of(text: str, dimensions: int = EMBEDDING_SIZE) -> list[float]:
    """The scripted unit vector of `text`: its hash's first bytes, centred and normalised."""
    raw = [b - 127.5 for b in hashlib.sha256(text.encode()).digest()[:dimensions]]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


async def embeddings(request: web.Request) -> web.Response:
    body = await request.json()
    status_for = request.app[STATE].status_for
    if body.get("model") in status_for:
        status, payload = status_for[body["model"]]
        return web.json_response(payload, status=status)
    inputs = body["input"]
    if not isinstance(inputs, list) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]  # one text, or one array of token ids
    # token ids embed as their decimal text, and count one token each
    texts = [t if isinstance(t, str) else " ".join(map(str, t)) for t in inputs]
    dimensions = body.get("dimensions") or EMBEDDING_SIZE
    if dimensions > EMBEDDING_SIZE:
        error = {"message": "too many dimensions", "type": "invalid_request_error"}
        return web.json_response({"error": error | {"param": "dimensions"}}, status=400)
    data = [
        {"object": "embedding", "index": i, "embedding": embedding_of(t, dimensions)}
        for i, t in enumerate(texts)
    ]
    tokens = sum(max(1, len(t.split())) for t in texts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    answer = {"object": "list", "data": data, "model": body["model"], "usage": usage}
    return web.json_response(answer)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})


def make_app(state: UpstreamState | None = None) -> web.Application:
    app = web.Application(middlewares=[outage_middleware])
    app[STATE] = state = state or UpstreamState()
    app[OUTAGE] = state.outage
    app[STATS] = state.stats
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", legacy_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_chaos/stats", stats)
    app.router.add_post("/_chaos/down", down)
    return app


async def serve(state: UpstreamState, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, on a listener an outage can close (`how=refuse`)."""
    runner = web.AppRunner(make_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    listener = SiteListener(runner, host, port)
    await listener.open()
    state.outage.listener = listener
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, help="end every completion at this many tokens")
    parser.add_argument("--first-token-ms", type=float, help="delay before the first token")
    parser.add_argument("--concurrency", type=int, help="streams served at once; others wait")
    parser.add_argument(
        "--faults", type=float, default=0.0, metavar="RATE", help="share of streams faulted"
    )
    parser.add_argument(
        "--fault-kinds",
        default=",".join(FAULT_KINDS),
        help=f"the kinds drawn from, comma-separated (default: all of {','.join(FAULT_KINDS)})",
    )
    parser.add_argument("--seed", type=int, help="seeds which requests fail, and how")
    parser.add_argument("--stall-s", type=float, default=30.0, help="how long a stall lasts")
    args = parser.parse_args()
    kinds = tuple(args.fault_kinds.split(","))
    faults = Faults(rate=args.faults, kinds=kinds, seed=args.seed, stall_s=args.stall_s)
    state = UpstreamState(
        delay_ms=args.delay_ms,
        max_tokens=args.max_tokens,
        first_token_ms=args.first_token_ms,
        concurrency=args.concurrency,
        faults=faults,
    )
    asyncio.run(serve(state, args.host, args.port))


if __name__ == "__main__":
    main()
