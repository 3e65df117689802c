"""Adapter for our own `sluice worker` (docs/worker-api.md): NDJSON token events over HTTP.

Two ways to abort: `abort()` asks the worker in-band (`POST /v1/abort`) and the stream then
confirms with the `finish`/`abort` lines, which report what the abort cost; closing the response
(the iterator being closed or cancelled) drops the connection, which the worker also treats as an
abort at its next step boundary, but nothing comes back.

Response formats and tools are the worker's to enforce (docs/worker-api.md): the adapter passes
them on, and turns the worker's whole `tool_call` lines into tool-call deltas with an OpenAI id.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
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
from adapters.events import (
    Aborted,
    Accepted,
    Admitted,
    ErrorEvent,
    Event,
    Finish,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from adapters.framing import LineSplitter
from adapters.requests import ChatRequest
from wire import api
from wire.embed_body import Embeddings, EmbedInput, EmbedRequest, read_embed_answer
from wire.generate_body import GenerateRequest
from wire.output_spec import parse_response_format, parse_tools
from wire.sampling_params import InvalidParam, SamplingParams
from wire.share import DEFAULT_SHARE, Share

_PASSED_CODES = frozenset(
    {
        "context_length_exceeded",
        "invalid_type",
        "invalid_value",
        "unsupported_parameter",
        "schema_too_complex",
    }
)
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=2)  # an abort that cannot be asked fast is closed
COUNT_TIMEOUT = aiohttp.ClientTimeout(total=COUNT_TIMEOUT_S)


def engine_slots(max_num_seqs: int) -> int:
    """The runs a gateway sends one worker before it queues them itself (design §12): a full
    batch running and as many waiting in the engine, where its fair scheduler orders them and
    lets a waiting one of a higher tier or an under-served tenant take a running one's slot at
    the next step; beyond that, runs wait in the gateway's fair queues."""
    return 2 * max_num_seqs


def generate_request(request: ChatRequest, request_id: str) -> GenerateRequest:
    """The worker's `/v1/generate` body for a chat request."""
    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=tuple(request.stop),
        n=request.n,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
    )
    messages = [_message(m.to_dict()) for m in request.messages]
    try:
        response_format = parse_response_format(request.response_format)
        tools = parse_tools(request.tools, request.tool_choice)
    except InvalidParam as e:  # a shape the gateway let through but the worker cannot take
        raise BackendRejected(str(e), e.param) from None
    return GenerateRequest(
        request_id,
        messages,
        params,
        response_format,
        tools,
        request.cache_salt,
        request.continuation,
        request.shared_system_prompt,
        request.share,
        request.continue_final_message,
        request.prompt,
    )


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """The worker's message: string content, tool fields only where set."""
    return {**message, "content": message.get("content") or ""}


def call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + secrets.token_urlsafe(18)


def to_event(line: api.Line) -> Event:
    """The internal event for one line of the worker's stream."""
    kind = type(line)
    if kind is api.TextLine:
        return TextDelta(line.text, line.index, line.tokens, line.logprobs, line.token_ids)
    if kind is api.ToolCallLine:
        return ToolCallDelta(
            line.call_index, line.arguments, call_id(), line.name, line.index, line.token_ids
        )
    if kind is api.FinishLine:
        if line.reason == "abort":
            return Aborted(
                line.index, line.completion_tokens, line.tail_tokens or 0, line.stop_latency_ms
            )
        stop_string = line.stop_string if isinstance(line.stop_string, str) else None
        return Finish(line.reason, line.index, stop_string)
    if kind is api.AdmittedLine:
        return Admitted()
    if kind is api.AcceptedLine:
        return Accepted(prompt_tokens=line.prompt_tokens)
    if kind is api.UsageLine:
        return Usage(line.prompt_tokens, line.completion_tokens)
    return ErrorEvent("worker_error", "The model worker failed while generating.")


class WorkerAdapter:
    """One `sluice worker` reached at `base_url`."""

    continues_runs = True  # takes a `continuation` (a run another worker started): a pool's cue
    continues_text = True  # takes `continue_final_message` (a run an upstream started)

    def __init__(self, base_url: str, name: str = "worker") -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._model: ModelInfo | None = None
        self._max_body: int | None = None  # the worker's own body limit, as it reports it
        self._slots: int | None = None  # engine_slots of its max_num_seqs, as it reports it

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )
        await self._load_model()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _load_model(self) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.base_url}/v1/model") as resp:
                info = orjson.loads(await resp.read())
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendUnavailable(f"worker {self.name} is unreachable") from exc
        if info.get("api_version") != api.API_VERSION:
            raise BackendFailed(f"worker {self.name} speaks API version {info.get('api_version')}")
        self._model = ModelInfo(
            info["id"], max_model_len=info.get("max_model_len"), created=info.get("created")
        )
        self._max_body = info.get("max_body_bytes")
        max_num_seqs = info.get("max_num_seqs")
        self._slots = engine_slots(max_num_seqs) if isinstance(max_num_seqs, int) else None

    async def models(self) -> list[ModelInfo]:
        return [self._model] if self._model else []

    async def ready(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def stats(self) -> dict[str, Any] | None:
        """The worker's own load and step counter (GET /v1/stats), or None when it will not say."""
        assert self._session is not None
        try:
            async with self._session.get(
                f"{self.base_url}/v1/stats", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    def capacity(self) -> int | None:
        """Runs this gateway may stream from the worker at once (flow control, design §12);
        None from a worker that does not say how many it runs."""
        return self._slots

    def unsupported_param(self, request: ChatRequest) -> str | None:
        """Nothing: tools, tool_choice and response_format are enforced by the worker."""
        return None

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        assert self._session is not None
        body = generate_request(request, request_id).to_json()
        if self._max_body is not None and len(body) > self._max_body:
            # NOTE: only a worker started with a lower --max-body-bytes than the gateway's
            # limit gets here; the client hears what it would have heard from the gateway.
            raise BackendRejected("The request body is too large.", None, status=413)
        headers = {"Content-Type": "application/json"}
        if request.trace is not None:  # the worker's span becomes the run span's child
            headers["traceparent"] = request.trace.traceparent
        try:
            resp = await self._session.post(
                f"{self.base_url}/v1/generate", data=body, headers=headers
            )
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendUnavailable("The model worker is unreachable.") from exc
        try:
            if resp.status != 200:
                await _raise_for_status(resp)
            lines = LineSplitter()
            async for data in resp.content.iter_any():
                batch = [to_event(line) for raw in lines.feed(data) if (line := api.decode(raw))]
                if batch:
                    yield batch
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendFailed("The connection to the model worker was lost.") from exc
        finally:
            resp.close()

    async def embed(
        self,
        inputs: list[EmbedInput],
        dimensions: int | None,
        request_id: str,
        share: Share = DEFAULT_SHARE,
    ) -> Embeddings:
        """The worker's unit vectors of `inputs` (`POST /v1/embed`), in order."""
        assert self._session is not None
        body = EmbedRequest(request_id, inputs, dimensions, share).to_json()
        try:
            async with self._session.post(
                f"{self.base_url}/v1/embed",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as resp:
                if resp.status != 200:
                    await _raise_for_status(resp)
                return read_embed_answer(await resp.read())
        except (aiohttp.ClientError, OSError) as exc:
            raise BackendUnavailable("The model worker is unreachable.") from exc
        except ValueError as exc:  # not JSON, or not an answer this version reads
            raise BackendFailed("The model worker sent a malformed answer.") from exc

    async def count_tokens(self, request: ChatRequest, request_id: str) -> TokenCount | None:
        """The prompt's tokens as the worker renders them for generation (`POST /v1/count`,
        the same body as `/v1/generate`); None from a worker without the route, or one that
        cannot answer now (the caller estimates instead)."""
        assert self._session is not None
        body = generate_request(request, request_id).to_json()
        try:
            async with self._session.post(
                f"{self.base_url}/v1/count",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=COUNT_TIMEOUT,
            ) as resp:
                if resp.status == 400:
                    await _raise_for_status(resp)
                if resp.status != 200:
                    return None
                tokens = orjson.loads(await resp.read()).get("input_tokens")
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return None
        return TokenCount.read(tokens, "worker")

    async def abort(self, request_id: str) -> bool:
        """Ask the worker to stop `request_id`; False when it does not know it or is unreachable
        (the caller then closes the stream, which aborts it all the same)."""
        if self._session is None:
            return False
        try:
            async with self._session.post(
                f"{self.base_url}/v1/abort",
                data=orjson.dumps({"request_id": request_id}),
                headers={"Content-Type": "application/json"},
                timeout=ABORT_TIMEOUT,
            ) as resp:
                if resp.status != 200:
                    return False
                return orjson.loads(await resp.read()).get("aborted") is True
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return False


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    try:
        error = orjson.loads(await resp.read()).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        error = {}
    if resp.status == 400:
        # our own worker: its messages and codes are ours to pass on
        code = error.get("code") if error.get("code") in _PASSED_CODES else "invalid_value"
        raise BackendRejected(
            str(error.get("message", "Invalid request.")), error.get("param"), code=code
        )
    if resp.status == 413:
        raise BackendRejected("The request body is too large.", None, status=413)
    if resp.status == 503:
        told = parse_retry_after(resp.headers.get("retry-after"))
        raise BackendUnavailable(
            "The model worker is busy.",
            1.0 if told is None else told,
            status=503,
            upstream_retry_after=told,
        )
    raise BackendFailed(f"worker answered HTTP {resp.status}")
