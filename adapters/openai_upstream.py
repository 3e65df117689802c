"""Adapter for any OpenAI-compatible server (vLLM, SGLang, TGI's OpenAI route, …).

Every request goes upstream as a stream with usage included, whether or not the client asked to
stream: the gateway assembles non-streaming answers itself, and closing the upstream connection is
how a request is aborted. Upstream error text never passes this module. A request with a raw
prompt (a legacy completion, `ChatRequest.prompt`) goes to the upstream's own `/completions`,
its `text_completion` chunks read by adapters/completion_chunks.py into the same events.
Embeddings are proxied to the upstream's `/embeddings` (floats asked for; the gateway encodes).
A prompt is counted by the upstream's `POST /tokenize` at its server root (vLLM's), where it has
one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson

from adapters.base import (
    COUNT_TIMEOUT_S,
    BackendFailed,
    BackendRejected,
    BackendUnavailable,
    ModelInfo,
    TokenCount,
    parse_retry_after,
)
from adapters.chat_chunks import chunk_events
from adapters.completion_chunks import completion_chunk_events
from adapters.events import Accepted, Event
from adapters.framing import SSEDataSplitter
from adapters.requests import ChatRequest
from wire.embed_body import Embeddings, EmbedInput
from wire.share import DEFAULT_SHARE, Share

COUNT_TIMEOUT = aiohttp.ClientTimeout(total=COUNT_TIMEOUT_S)
_OPTIONAL = (
    "max_tokens",
    "seed",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "user",
    "metadata",
)


def upstream_body(request: ChatRequest, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [m.to_dict() for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": request.temperature,
        "top_p": request.top_p,
        "n": request.n,
    }
    if request.top_k:  # vLLM's and SGLang's extension; another upstream judges it
        body["top_k"] = request.top_k
    if request.continue_final_message:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if request.stop:
        body["stop"] = request.stop
    if request.presence_penalty:
        body["presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        body["frequency_penalty"] = request.frequency_penalty
    for name in _OPTIONAL:
        value = getattr(request, name)
        if value not in (None, False, 0):
            body[name] = value
    return body


def upstream_completion_body(request: ChatRequest, model: str) -> dict[str, Any]:
    """The legacy `/completions` body for a request with a raw prompt (`request.prompt`)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": request.temperature,
        "top_p": request.top_p,
        "n": request.n,
    }
    if request.stop:
        body["stop"] = request.stop
    if request.presence_penalty:
        body["presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        body["frequency_penalty"] = request.frequency_penalty
    if request.logprobs:
        body["logprobs"] = request.top_logprobs  # the legacy form: how many alternatives
    for name in ("max_tokens", "seed", "user"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    return body


class OpenAIUpstreamAdapter:
    """Serves model `name` from the OpenAI-compatible API at `base_url` (ending in `/v1`)."""

    # continues a run another member started from its text (vLLM's and SGLang's
    # `continue_final_message`, which sluicegate's own chat route takes too)
    continues_text = True

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None = None,
        upstream_model: str | None = None,
        capacity: int | None = None,
    ) -> None:
        """`capacity`: the runs the server takes at once before it queues (design §12); None:
        unknown, so the gateway never holds runs back for it."""
        self.name = name
        self._capacity = capacity
        self.base_url = base_url.rstrip("/")
        self.upstream_model = upstream_model or name
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._counts = True  # False once its `/tokenize` answered that it has none

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo(self.name, owned_by="upstream")]

    async def ready(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{self.base_url}/models",
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=2),
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def capacity(self) -> int | None:
        return self._capacity

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return None  # the upstream is the judge; its 400s are relayed with the field named

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        assert self._session is not None
        if request.prompt is None:
            path, read = "chat/completions", chunk_events
            body = orjson.dumps(upstream_body(request, self.upstream_model))
        else:  # a legacy completion: the upstream's own, no chat template
            path, read = "completions", completion_chunk_events
            body = orjson.dumps(upstream_completion_body(request, self.upstream_model))
        headers = {**self._headers, "X-Request-Id": request_id}
        if request.trace is not None:  # W3C trace context: the upstream's spans join the run's
            headers["traceparent"] = request.trace.traceparent
        try:
            resp = await self._session.post(f"{self.base_url}/{path}", data=body, headers=headers)
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendUnavailable("The upstream model server is unreachable.") from exc
        try:
            if resp.status != 200:
                await _raise_for_status(resp)
            yield [Accepted()]
            splitter = SSEDataSplitter()
            done = False
            while data := await resp.content.readany():  # b"" only at the end of the body
                batch, ended, bad = _events_of(splitter.feed(data), request.n, read)
                done = done or ended
                if batch:
                    yield batch
                if bad is not None:  # what came before it stays sent; the rest comes elsewhere
                    raise BackendFailed("The upstream sent a malformed chunk.") from bad
            if not done:  # cut short: what it sent stays sent, the rest must come elsewhere
                raise BackendFailed("The upstream's stream ended without [DONE].")
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendFailed("The connection to the upstream model server was lost.") from exc
        finally:
            # NOTE: a body read to its end hands its connection back for the next run (no new
            # connection per stream); one cut short is closed, which is the abort upstream.
            if resp.content.is_eof():
                resp.release()
            else:
                resp.close()

    async def embed(
        self,
        inputs: list[EmbedInput],
        dimensions: int | None,
        request_id: str,
        share: Share = DEFAULT_SHARE,
    ) -> Embeddings:
        """The upstream's vectors of `inputs` (its `/embeddings`, as floats) and its usage;
        `share` is for our workers' scheduling, which an upstream has no word for."""
        assert self._session is not None
        body: dict[str, Any] = {
            "model": self.upstream_model,
            "input": inputs,
            "encoding_format": "float",
        }
        if dimensions is not None:
            body["dimensions"] = dimensions
        headers = {**self._headers, "X-Request-Id": request_id}
        try:
            async with self._session.post(
                f"{self.base_url}/embeddings", data=orjson.dumps(body), headers=headers
            ) as resp:
                if resp.status != 200:
                    await _raise_for_status(resp)
                return _embeddings(orjson.loads(await resp.read()), len(inputs))
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendUnavailable("The upstream model server is unreachable.") from exc
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # not OpenAI's shape
            raise BackendFailed("The upstream sent a malformed embeddings answer.") from exc

    async def count_tokens(self, request: ChatRequest, request_id: str) -> TokenCount | None:
        """The upstream's own count of the prompt (vLLM's `POST /tokenize` at the server root,
        `{"model", "messages"}` → `{"count"}`); None where it has none (remembered after its
        first 404 or 405) or cannot answer now: the caller estimates."""
        assert self._session is not None
        if not self._counts or request.prompt is not None:
            return None
        body: dict[str, Any] = {
            "model": self.upstream_model,
            "messages": [m.to_dict() for m in request.messages],
        }
        if request.tools:
            body["tools"] = request.tools
        root = self.base_url.removesuffix("/v1")
        headers = {**self._headers, "X-Request-Id": request_id}
        try:
            async with self._session.post(
                f"{root}/tokenize", data=orjson.dumps(body), headers=headers, timeout=COUNT_TIMEOUT
            ) as resp:
                if resp.status in (404, 405):
                    self._counts = False
                if resp.status != 200:
                    return None
                count = orjson.loads(await resp.read()).get("count")
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return None
        return TokenCount.read(count, "upstream")

    async def abort(self, request_id: str) -> bool:
        """No in-band abort in the OpenAI API: closing the stream is the abort (and the stream
        never yields `Admitted` or `Aborted`)."""
        return False


def _events_of(
    payloads: list[bytes], n: int, read: Callable[[Any, int], list[Event]] = chunk_events
) -> tuple[list[Event], bool, ValueError | None]:
    """The events of a read's SSE payloads (each read by `read`: chat chunks or legacy
    completion chunks) up to the first malformed one; whether `[DONE]` came; the malformed
    chunk's error, if one did."""
    events: list[Event] = []
    done = False
    for payload in payloads:
        if payload == b"[DONE]":
            done = True
            continue
        try:
            events += read(orjson.loads(payload), n)
        except ValueError as exc:  # orjson.JSONDecodeError and BadChunk both are
            return events, done, exc
    return events, done, None


def _embeddings(answer: dict[str, Any], count: int) -> Embeddings:
    """OpenAI's embeddings list read back in input order; ValueError when it is not one
    vector of numbers per input."""
    items = sorted(answer["data"], key=lambda item: item["index"])
    vectors = [item["embedding"] for item in items]
    if [item["index"] for item in items] != list(range(count)) or not all(
        isinstance(v, list) and all(isinstance(x, int | float) for x in v) for v in vectors
    ):
        raise ValueError("not one vector per input")
    tokens = answer.get("usage", {}).get("prompt_tokens", 0)
    return Embeddings(vectors, tokens if isinstance(tokens, int) else 0)


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    try:
        error = orjson.loads(await resp.read()).get("error") or {}
        param = error.get("param") if isinstance(error.get("param"), str) else None
    except (orjson.JSONDecodeError, AttributeError):
        param = None
    if resp.status in (400, 422):
        what = f"parameter '{param}'" if param else "the request"
        raise BackendRejected(f"The upstream model server rejected {what}.", param)
    if resp.status == 404:
        raise BackendRejected("The upstream model server does not serve this model.", "model", 404)
    if resp.status in (429, 503):
        told = parse_retry_after(resp.headers.get("retry-after"))
        raise BackendUnavailable(
            "The upstream model server is overloaded.",
            1.0 if told is None else told,
            status=resp.status,
            upstream_retry_after=told,
        )
    raise BackendFailed(f"upstream answered HTTP {resp.status}")
