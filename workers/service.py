"""The worker behind the HTTP routes: loads the model, runs the engine loop, prepares requests.

Loading happens on a daemon thread after the server is already listening, so `/health` can say
503 during a first-use conversion of the default model, and SIGTERM is never stuck behind it.
Prompts are rendered on one helper thread: the event loop only parses JSON and moves bytes.
Grammars (response formats, forced tool calls) compile on the grammar compiler's own pool under
a timeout, before the request enters the engine, so the engine thread never compiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry

from wire import api
from wire.api import BadRequest
from wire.embed_body import Embeddings, EmbedRequest
from wire.generate_body import GenerateBody
from workers.async_engine import AsyncEngine
from workers.chat import ChatTemplateError, raw_prompt, render_prompt, shared_prefix_len
from workers.config import WorkerConfig
from workers.embedding import EmbeddingJob, hidden_size
from workers.engine import Engine
from workers.engine_outputs import ContextTooLong, EngineStats
from workers.metrics import WorkerMetrics
from workers.model_loader import (
    context_length,
    dtype_name,
    load_model,
    resolve_model_path,
    served_model_id,
)
from workers.request import EngineRequest

if TYPE_CHECKING:
    from workers.grammar import CompiledGrammar, GrammarCompiler

log = structlog.get_logger("sluice.worker")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model and tokenizer already in memory, and the id they are served under."""

    model: Any
    tokenizer: Any
    model_id: str


def load_configured_model(config: WorkerConfig) -> LoadedModel:
    """Resolve, convert if needed, and load the model that `config` names (blocking)."""
    path = resolve_model_path(config.model)
    model, tokenizer = load_model(path, config.device, config.dtype)
    return LoadedModel(model, tokenizer, served_model_id(config.model, path))


class WorkerService:
    """One per app: the loaded model, the engine loop and the tokenizing thread."""

    def __init__(
        self, config: WorkerConfig, registry: CollectorRegistry, loaded: LoadedModel | None = None
    ) -> None:
        self.config = config
        self.metrics = WorkerMetrics(registry, self.stats)
        self._preloaded = loaded
        self._loaded: LoadedModel | None = None
        self._started_at = 0
        self._engine: AsyncEngine | None = None
        self._tokenize: ThreadPoolExecutor | None = None
        self._grammar: GrammarCompiler | None = None
        self.ready = asyncio.Event()
        self.failed = asyncio.Event()

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self._engine is not None and self._engine.is_running

    async def start(self) -> None:
        """Load (on a daemon thread) and start the engine loop; sets `ready` or `failed`."""
        try:
            loaded = self._preloaded or await self._load_in_background()
            device = next(loaded.model.parameters()).device.type
            engine = Engine(loaded.model, loaded.tokenizer, **self.config.engine_kwargs(device))
            self._grammar = await asyncio.to_thread(self._grammar_compiler, loaded, engine)
            self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-tokenize")
            self._engine = AsyncEngine(engine, on_step=self.metrics.observe_step)
            self._engine.start()
            self._loaded = loaded
            self._started_at = int(time.time())
            self.ready.set()
        except Exception as e:  # the edge: reported by the CLI, which exits non-zero
            log.error("worker failed to start", error=type(e).__name__, message=str(e))
            self.failed.set()

    async def _load_in_background(self) -> LoadedModel:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[LoadedModel] = loop.create_future()

        def load() -> None:
            result, error = None, None
            try:
                result = load_configured_model(self.config)
            except BaseException as e:  # handed to the loop, which logs it and exits non-zero
                error = e
            with contextlib.suppress(RuntimeError):  # a closed loop: the worker is exiting
                loop.call_soon_threadsafe(_settle, future, result, error)

        threading.Thread(target=load, name="sluice-load", daemon=True).start()
        return await future

    def _grammar_compiler(self, loaded: LoadedModel, engine: Engine) -> GrammarCompiler | None:
        """llguidance's view of the tokenizer (~1 s for 49k tokens); None without llguidance,
        and then a constrained request is refused."""
        try:
            from workers.grammar import GrammarCompiler
        except ImportError:
            log.warning("llguidance is not installed: no response_format nor forced tool calls")
            return None
        return GrammarCompiler(
            loaded.tokenizer,
            loaded.model.config.vocab_size,
            engine.stop_ctx.eos_token_ids,
            timeout_s=self.config.grammar_timeout_s,
        )

    async def stop(self) -> None:
        """End every live stream and the engine thread (idempotent)."""
        if self._engine is not None:
            await self._engine.stop()
        if self._tokenize is not None:
            self._tokenize.shutdown(wait=False, cancel_futures=True)
        if self._grammar is not None:
            self._grammar.close()

    def stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    def model_info(self) -> dict[str, Any]:
        loaded = self._require_loaded()
        model = loaded.model
        return {
            "id": loaded.model_id,
            "max_model_len": context_length(model.config),
            "vocab_size": model.config.vocab_size,
            "device": next(model.parameters()).device.type,
            "dtype": dtype_name(model.dtype),
            "api_version": api.API_VERSION,
            "max_body_bytes": self.config.max_body_bytes,
            "max_num_seqs": self.config.max_num_seqs,
            "created": self._started_at,  # when this worker began serving the model
        }

    async def prepare(self, body: GenerateBody) -> EngineRequest:
        """Render and check the prompt; raises BadRequest (param named) before any stream."""
        loaded = self._require_loaded()
        engine = self._require_engine()
        config = loaded.model.config
        vocab = config.vocab_size
        if any(t >= vocab for t in body.params.stop_token_ids):
            raise BadRequest(f"stop_token_ids must be below {vocab}", "stop_token_ids")
        if any(t >= vocab for t in body.continuation):
            raise BadRequest(f"continuation ids must be below {vocab}", "continuation")
        loop = asyncio.get_running_loop()
        prompt_ids = await self._prompt_ids(loaded, body)
        try:
            engine.check_fits(len(prompt_ids), body.params.max_tokens, len(body.continuation))
        except ContextTooLong as e:
            param = "prompt" if body.prompt is not None and e.param == "messages" else e.param
            raise BadRequest(str(e), param, "context_length_exceeded") from None
        grammar = await self._compile(body)
        if grammar is not None and body.continuation:
            await self._check_follows(grammar, body.continuation)
        parse_tools = body.tools is not None and body.tools.offered
        shared = 0
        if body.shared_system_prompt and body.prompt is None:
            shared = await loop.run_in_executor(
                self._tokenize, shared_prefix_len, loaded.tokenizer, body.messages, prompt_ids
            )
        return EngineRequest(
            body.request_id,
            prompt_ids,
            body.params,
            grammar,
            parse_tools,
            body.cache_salt,
            body.continuation,
            shared_prefix_len=shared,
            share=body.share,
        )

    async def _prompt_ids(self, loaded: LoadedModel, body: GenerateBody) -> list[int]:
        """The prompt's ids, on the tokenizing thread: a raw prompt as it is, messages through
        the chat template."""
        loop = asyncio.get_running_loop()
        if isinstance(body.prompt, tuple):  # token ids: taken as they are
            vocab = loaded.model.config.vocab_size
            if any(t >= vocab for t in body.prompt):
                raise BadRequest(f"prompt token ids must be below {vocab}", "prompt")
            return list(body.prompt)
        if body.prompt is not None:  # raw text: no chat template
            return await loop.run_in_executor(
                self._tokenize, raw_prompt, loaded.tokenizer, body.prompt
            )
        try:
            return await loop.run_in_executor(
                self._tokenize,
                render_prompt,
                loaded.tokenizer,
                body.messages,
                body.tools,
                body.continue_final_message,
            )
        except ChatTemplateError as e:
            raise BadRequest(str(e), "messages") from None

    async def count(self, body: GenerateBody) -> int:
        """The prompt's tokens exactly as `prepare` renders it (chat template, tools), so a
        count equals the `prompt_tokens` a generation of the same body reports; nothing runs."""
        return len(await self._prompt_ids(self._require_loaded(), body))

    async def _compile(self, body: GenerateBody) -> CompiledGrammar | None:
        """The grammar the output must follow, compiled off the engine thread; a 400 naming the
        field when it cannot be (a bad or unsupported schema, a compile past the timeout)."""
        forced = body.tools is not None and body.tools.forced
        if body.response_format is None and not forced:
            return None
        if self._grammar is None:
            param = "response_format" if body.response_format is not None else "tool_choice"
            raise BadRequest(
                f"{param} needs constrained decoding, which this worker lacks (no llguidance)",
                param,
                "unsupported_parameter",
            )
        from workers.grammar import GrammarError

        try:
            return await self._grammar.compile(body.response_format, body.tools)
        except GrammarError as e:
            raise BadRequest(e.message, e.param, e.code) from None

    async def _check_follows(self, grammar: CompiledGrammar, continuation: tuple[int, ...]) -> None:
        """A 400 for a continuation the grammar refuses, found here, off the engine thread.

        NOTE: the engine replays what passed (continuation.py); a token after the one that
        ended the run is only found by that replay, and is an `invalid_continuation` error line.
        """
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(self._tokenize, grammar.accepts, continuation):
            raise BadRequest(
                "the continuation does not follow the response format or forced tool call",
                "continuation",
            )

    async def embed(self, body: EmbedRequest) -> Embeddings:
        """Unit vectors of the inputs (workers/embedding.py), computed through the engine's
        steps beside the running streams; BadRequest naming `input` or `dimensions` before any
        is computed."""
        loaded = self._require_loaded()
        model = loaded.model
        size = hidden_size(model)
        if body.dimensions is not None and body.dimensions > size:
            raise BadRequest(
                f"dimensions must be at most {size}, this model's embedding size", "dimensions"
            )
        if isinstance(body.inputs[0], str):  # texts (all of them: parse_embed saw to that)
            loop = asyncio.get_running_loop()
            prompts = await loop.run_in_executor(
                self._tokenize, _raw_prompts, loaded.tokenizer, body.inputs
            )
        else:  # token ids, as they are
            prompts = body.inputs
            vocab = model.config.vocab_size
            if any(t >= vocab for ids in prompts for t in ids):
                raise BadRequest(f"input token ids must be below {vocab}", "input")
        limit = self._require_engine().max_model_len
        for i, ids in enumerate(prompts):
            if not 0 < len(ids) <= limit:
                raise BadRequest(
                    f"input[{i}] is {len(ids)} tokens; this model takes 1 to {limit}",
                    "input",
                    "context_length_exceeded",
                )
        call = uuid.uuid4().hex
        jobs = [
            EmbeddingJob(f"embed-{call}-{i}", ids, body.dimensions, body.share)
            for i, ids in enumerate(prompts)
        ]
        vectors = await self._require_engine().embed(jobs)
        return Embeddings(vectors, sum(len(ids) for ids in prompts))

    def generate(self, request: EngineRequest) -> AsyncIterator[api.Line]:
        return self._require_engine().generate(request)

    def abort(self, request_id: str) -> bool:
        return self._engine.abort(request_id) if self._engine is not None else False

    def _require_loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise RuntimeError("the model is not loaded yet")
        return self._loaded

    def _require_engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("the engine is not running yet")
        return self._engine


def _raw_prompts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [raw_prompt(tokenizer, text) for text in texts]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
